"""One OpenAI choice of an answer, built from the router's GenerateResponse stream: its streamed
chunk pieces (`delta`) and its whole form (`choice`), for chat and for text completions.

- Text goes to `content` (`text` for completions); tool-call deltas (GenerateResponse.tool_calls,
  services/router/tools.py) to `tool_calls` as OpenAI streams them: a call's first delta carries
  its index, id, type and name, later ones argument fragments. The whole message has
  `content: null` when the answer was only calls.
- Logprobs (when asked for): chat's `{"content": [{token, logprob, bytes, top_logprobs}]}`, the
  legacy completions' `{tokens, token_logprobs, top_logprobs, text_offset}`. Values are the
  model's (raw log-softmax, ember.engine.sampler.token_logprobs); `bytes` are the token's own
  (Tokenizer.token_bytes), `token` their UTF-8 text (a partial character shows as U+FFFD). The
  end-of-sequence token that stops an answer is not listed (it is not part of the text).
"""
from __future__ import annotations


class Choice:
    def __init__(self, index: int, chat: bool, tokenizer, logprobs: bool):
        self.index, self.chat, self.tokenizer, self.want_logprobs = index, chat, tokenizer, logprobs
        self.text: list[str] = []
        self.calls: dict[int, dict] = {}
        self.logprobs: list = []  # TokenLogprob protobufs, in order
        self.final = None  # the finished GenerateResponse
        self.started = False  # its first chunk (chat: the role) was sent

    # -- streaming -------------------------------------------------------------------------------
    def delta(self, msg) -> dict | None:
        """This message's piece of the stream as one chunk `choices` entry; None when it adds nothing.
        Also records it (call `choice()` at the end)."""
        self._record(msg)
        if not (msg.text or msg.tool_calls or msg.finished or (self.want_logprobs and msg.logprobs)):
            return None
        before = sum(len(t) for t in self.text[:-1])  # (text offsets of a completion's tokens)
        entry = {"index": self.index, "finish_reason": msg.finish_reason if msg.finished else None,
                 "logprobs": self._logprobs(list(msg.logprobs), before) if self.want_logprobs else None}
        if not self.chat:
            return entry | {"text": msg.text}
        delta = {"content": msg.text} if msg.text else {}
        if msg.tool_calls:
            delta["tool_calls"] = [self._call_delta(d) for d in msg.tool_calls]
        return entry | {"delta": delta}

    def first_chunk(self) -> dict:
        """The chat stream's opening piece for this choice (OpenAI sends the role first)."""
        self.started = True
        return {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    # -- the whole answer ----------------------------------------------------------------------------
    def choice(self) -> dict:
        entry = {"index": self.index, "finish_reason": self.final.finish_reason,
                 "logprobs": self._logprobs(self.logprobs) if self.want_logprobs else None}
        text = "".join(self.text)
        if not self.chat:
            return entry | {"text": text}
        message = {"role": "assistant", "content": text if text or not self.calls else None}
        if self.calls:
            message["tool_calls"] = [{"id": c["id"], "type": "function",
                                      "function": {"name": c["name"], "arguments": c["arguments"]}}
                                     for _, c in sorted(self.calls.items())]
        return entry | {"message": message}

    # -- internals -----------------------------------------------------------------------------------
    def _record(self, msg) -> None:
        self.text.append(msg.text)
        for d in msg.tool_calls:
            call = self.calls.setdefault(d.index, {"id": d.id, "name": d.name, "arguments": ""})
            call["arguments"] += d.arguments
        self.logprobs.extend(msg.logprobs)
        if msg.finished:
            self.final = msg

    @staticmethod
    def _call_delta(d) -> dict:
        if d.id:
            return {"index": d.index, "id": d.id, "type": "function",
                    "function": {"name": d.name, "arguments": d.arguments}}
        return {"index": d.index, "function": {"arguments": d.arguments}}

    def _listed(self, logprobs: list) -> list:
        eos = self.tokenizer.eos_token_id
        return [lp for lp in logprobs if lp.token_id != eos]

    def _token(self, token_id: int) -> tuple[str, list[int]]:
        raw = self.tokenizer.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def _logprobs(self, logprobs: list, start: int = 0) -> dict:
        listed = self._listed(logprobs)
        if self.chat:
            content = []
            for lp in listed:
                token, raw = self._token(lp.token_id)
                top = [dict(zip(("token", "bytes"), self._token(t)), logprob=v)
                       for t, v in zip(lp.top_token_ids, lp.top_logprobs)]
                content.append({"token": token, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
            return {"content": content}
        tokens = [self._token(lp.token_id)[0] for lp in listed]
        offsets, at = [], start
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in listed],
                "top_logprobs": [{self._token(t)[0]: v for t, v in zip(lp.top_token_ids, lp.top_logprobs)}
                                 for lp in listed], "text_offset": offsets}
