"""LLMEngine: wires model, paged KV cache, block manager, scheduler, runner and sampler."""
from __future__ import annotations

import functools
import itertools
import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from ember.engine.block_manager import BlockManager, kv_groups
from ember.engine.config import EngineConfig
from ember.engine.constraints import Grammars, fill_mask
from ember.engine.detokenizer import update_text
from ember.engine.errors import CapacityError, IntegrityError, InvalidRequestError
from ember.engine.footprint import weights_not_resident
from ember.engine.kv_cache import PagedKVCache
from ember.engine.model_runner import ModelRunner
from ember.engine.outputs import RequestOutput
from ember.engine.sampler import adjust_logits, apply_masks, sample, token_logprobs
from ember.engine.sampling_params import SamplingParams
from ember.engine.scheduler import ScheduledBatch, Scheduler
from ember.engine.sequence import NO_TENANT, Sequence, Tenant
from ember.engine.speculation import NgramIndex, accepted_prefix
from ember.engine.step_policy import SLO
from ember.engine.workspace import engine_workspace
from ember.errors import NotFoundError
from ember.kernels import optimize
from ember.kv import wire
from ember.kv.block_hash import chain_hashes, root_hash
from ember.model.files import layout_of
from ember.model.loader import LoadedModel, load_model, read_metadata

log = logging.getLogger("ember.engine")

# Drafts per step when the engine speculates by default (batch-invariant path) or a request asks
# for it on an engine that does not. `ember bench speculative` (k = 0..4, batch 1, q4, C++ attention):
# 3 and 4 are the fastest (edit 2.1x, free text 1.5x over k=0, within noise of each other); k=2
# was when attention was torch ops (each extra row cost about what a token does).
DEFAULT_SPECULATIVE_TOKENS = 3
# Forced tokens appended after one sampled token at most (jump-forward decoding): the next step
# computes them as one chunk, so this bounds that chunk; a tool call's fixed parts are ~10 tokens.
JUMP_FORWARD_MAX = 64


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    cached_tokens: int
    block_hashes: list[bytes]
    logprobs: list | None = None  # TokenLogprob per token, when asked for


@dataclass
class EngineStats:
    num_computed_tokens: int = 0  # tokens run through the model (prefill and decode)
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_steps: int = 0
    num_draft_tokens: int = 0  # speculative drafts verified
    num_accepted_tokens: int = 0  # of those, kept (each one a decode step saved)
    num_forced_tokens: int = 0  # appended by jump-forward decoding (each one a decode step saved)


class LLMEngine:
    def __init__(self, config: EngineConfig = EngineConfig(), loaded: LoadedModel | None = None):
        if config.pinned_cpus():  # engine.cpus: before any thread starts (torch's and the kernels' pools inherit it)
            os.sched_setaffinity(0, config.pinned_cpus())
        torch.set_num_threads(config.torch_threads())
        self.config = config
        # ranks load their parts (ember.parallel)
        parallel = config.tensor_parallel > 1 or config.pipeline_parallel > 1 or config.expert_parallel > 1
        if config.expert_parallel > 1 and config.tensor_parallel > 1 and (
                config.expert_parallel != config.tensor_parallel or config.pipeline_parallel > 1):
            raise ValueError("expert_parallel with tensor_parallel spreads whole experts over the tensor-parallel "
                             "ranks: it must equal tensor_parallel, without pipeline_parallel (expert_parallel "
                             "combines with pipeline_parallel alone: each stage a group of expert-parallel ranks)")
        if config.pipeline_parallel == 1 and (config.pipeline_partition or config.pipeline_microbatches):
            raise ValueError("pipeline_partition and pipeline_microbatches need pipeline_parallel > 1")
        if parallel and loaded is not None:
            raise ValueError("a tensor-parallel engine loads its own shards: pass no loaded model")
        self.loaded = loaded or (read_metadata(config.model, config.dtype, config.weights) if parallel else
                                 load_model(config.model, config.dtype, config.weights, device=config.device))
        loaded_dtype = config.dtype if parallel else str(self.loaded.model.norm.weight.dtype).removeprefix("torch.")
        if (self.loaded.weights, loaded_dtype) != (config.weights, config.dtype):
            raise ValueError(f"the model was loaded as weights={self.loaded.weights!r}, dtype={loaded_dtype!r} but "
                             f"the config says {config.weights!r}, {config.dtype!r}; load it with the config's values")
        self.tokenizer = self.loaded.tokenizer
        args = self.loaded.args
        self.max_model_len = min(config.max_model_len or args.max_position, args.max_position)
        self.layout = layout_of(args, self.loaded.fingerprint, config.dtype, config.block_size)
        if not parallel:  # on the device before the pool is sized from what is left there
            self.loaded.model.to(torch.device(config.device))  # (its weights were read into host memory)
        num_blocks = config.num_kv_blocks
        if not num_blocks:  # what is left of the engine's memory budget, its weights counted whole and the
            # step's workspace at its limits too (ember.engine.workspace: the figure `ember plan memory` prints)
            pending = 0 if parallel or config.kv_cache_mb else weights_not_resident(self.loaded.model)
            pending += engine_workspace(args, config, self.max_model_len).peak_bytes
            num_blocks = config.pool_bytes(pending) // self.layout.block_bytes
        # every expert-parallel rank holds the whole cache, as does every tensor-parallel rank of a latent-attention
        # model: on one host's memory the pool is split
        copies = (config.tensor_parallel if args.mla is not None else 1) if config.tensor_parallel > 1 \
            else config.expert_parallel
        if copies > 1 and config.device == "cpu" and not config.num_kv_blocks:
            num_blocks //= copies
        if parallel:
            if config.pipeline_parallel > 1:  # (each stage a group of tensor- or expert-parallel ranks)
                from ember.parallel.pipeline_parallel import PipelineParallelRunner as Runner
                name = f"pipeline-parallel-{config.pipeline_parallel}"
                if config.tensor_parallel > 1:
                    name = f"tensor-parallel-{config.tensor_parallel}-x-{name}"
                if config.expert_parallel > 1:
                    name = f"expert-parallel-{config.expert_parallel}-x-{name}"
            elif config.tensor_parallel == 1:
                from ember.parallel.expert_parallel import ExpertParallelRunner as Runner
                name = f"expert-parallel-{config.expert_parallel}"
            else:  # (expert_parallel > 1: whole experts over the tensor-parallel ranks)
                from ember.parallel.tensor_parallel import TensorParallelRunner as Runner
                name = f"tensor-parallel-{config.tensor_parallel}"
                if config.expert_parallel > 1:
                    name = f"{name}-x-expert-parallel-{config.expert_parallel}"
            self.runner = Runner(config, self.layout, num_blocks)
            self.cache = self.runner.cache  # whole-model blocks in and out, every rank its part
            self.kernels = [*self.runner.kernels, name]
            groups = None
        else:  # hybrid allocation: pages of KV groups (its chunked layers keep only the current chunk's)
            groups = kv_groups(args.attention_chunks) if config.hybrid_kv else None
            self.cache = PagedKVCache(self.layout, num_blocks, torch.device(config.device), groups)
        pages = num_blocks if groups is None else self.cache.num_blocks  # (groups: a block id is a page)
        self.block_manager = BlockManager(pages, config.block_size, root_hash(self.layout), groups,
                                          max_step_tokens=config.max_num_batched_tokens)
        self.frame_template = wire.layout_header(self.layout, self.block_manager.root_hash)  # what frames must say
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   slo=SLO(config.slo_ttft_s, config.slo_tpot_s))
        if not parallel:
            on_cpu = config.device == "cpu"
            self.kernels = optimize(self.loaded.model) if config.optimize and on_cpu else []
            capture = () if config.enforce_eager or not config.optimize else tuple(config.capture_sizes)
            self.runner = ModelRunner(self.loaded.model, self.cache, capture, config.attention_backend)
            if self.runner.captured is not None:
                self.kernels = [*self.kernels, "captured-step"]
        if config.attention_backend == "triton":
            self.kernels = [*self.kernels, "triton-paged-decode-attention"]
        eos = self.tokenizer.eos_token_id
        self.eos_token_id = eos if eos is not None else args.eos_token_id
        self.grammars = Grammars(self.tokenizer.backend.to_str(), args.vocab_size, self.eos_token_id)
        # batch-invariant steps (bf16 on CPU) give a position the same logits in a verify step as in a
        # decode step, so speculation changes no token there; SDPA (fp32) and Triton do not promise that
        batch_invariant = config.device == "cpu" and config.dtype != "float32" and config.attention_backend != "triton"
        auto = DEFAULT_SPECULATIVE_TOKENS if batch_invariant else 0
        self.speculative_tokens = auto if config.speculative_tokens is None else config.speculative_tokens
        self.ngram_range = (config.speculative_ngram_min, config.speculative_ngram_max)
        self.speculative_max_batch = config.speculative_max_batch
        self.jump_forward = config.jump_forward
        self.seqs: dict[str, Sequence] = {}
        self.stats = EngineStats()
        self._ids = itertools.count()
        # called with each step's batch once it is scheduled, before the model runs it (the engine core's
        # live state: what the step computes, from when); None: nothing
        self.on_batch: Callable[[ScheduledBatch], None] | None = None

    # -- requests ----------------------------------------------------------------------
    def close(self) -> None:
        """Stop what the engine started (a tensor-parallel engine's rank processes); idempotent."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def add_request(self, prompt: str | list[int], params: SamplingParams = SamplingParams(),
                    request_id: str | None = None, output_prefix: list[int] = (), check_queue: bool = True,
                    cache_salt: bytes = b"", shared_blocks: int = 0, streamed: bool = False,
                    tenant: Tenant = NO_TENANT) -> str:
        """Queue a request. `output_prefix`: tokens of this request already generated
        elsewhere (the first token, sampled by a prefill server); they count towards
        max_tokens and the text, whose part already streamed is not streamed again.
        `cache_salt`, `shared_blocks`: its tenant's hash chain (ember.kv.block_hash).
        `streamed`: its KV is sent on chunk by chunk as it prefills (its chunks halve). `tenant`: whose
        it is, for the scheduler's fair queue."""
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.seqs:
            raise InvalidRequestError(f"request_id {request_id!r} is already running")
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_fits(token_ids, params)  # (its constraint is checked as its matcher is made, below)
        if check_queue:  # (the engine core checks when the request arrives, counting its loads too)
            self.check_queue(len(token_ids))
        if len(output_prefix) >= params.max_tokens:
            raise InvalidRequestError("output_prefix already reaches max_tokens: nothing left to generate")
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        seq = Sequence(request_id, token_ids + list(output_prefix), len(token_ids), params, seed,
                       cache_salt=cache_salt, shared_blocks=shared_blocks, streamed=streamed, tenant=tenant)
        if params.constraint is not None:  # its grammar state continues after what was generated elsewhere
            seq.matcher = self.grammars.matcher(params.constraint, output_prefix)
        if output_prefix:
            update_text(seq, self.tokenizer.decode, final=False)  # = streamed_text: already sent
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        self.stats.num_prompt_tokens += len(token_ids)
        return request_id

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError / CapacityError for a request this engine can never serve."""
        self._check_fits(token_ids, params)
        if params.constraint is not None:  # compiled (cached), its first mask computed: a bad grammar fails
            self.grammars.matcher(params.constraint)  # here, before any work is queued

    def _check_fits(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise InvalidRequestError("prompt is empty")
        vocab = self.loaded.args.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"the model's context length {self.max_model_len}; shorten the prompt or lower max_tokens")
        if self.block_manager.pages_needed(total) > self.block_manager.num_blocks:
            raise CapacityError(
                f"prompt + max_tokens = {total} tokens needs more KV blocks than the pool holds "
                f"({self.block_manager.num_blocks} blocks of {self.config.block_size}); raise kv_cache_mb")

    def check_queue(self, num_tokens: int, also_waiting: int = 0, also_tokens: int = 0) -> None:
        """CapacityError when the waiting queue (plus `also_*` queued elsewhere) has no room for one
        more request of `num_tokens` prompt tokens: bounded memory, and a fast refusal under overload."""
        waiting = self.scheduler.waiting
        queued = len(waiting) + also_waiting
        tokens = sum(s.prompt_len for s in waiting) + also_tokens + num_tokens
        if queued >= self.config.max_waiting_requests or tokens > self.config.max_waiting_tokens:
            raise CapacityError(f"the engine's queue is full ({queued} requests waiting, limit "
                                f"{self.config.max_waiting_requests}; {tokens} prompt tokens with this one, limit "
                                f"{self.config.max_waiting_tokens}); retry shortly")

    def expert_tokens(self) -> list[int]:
        """Tokens routed to each expert since start, over all MoE layers ([] for a dense model). The
        driver's model routes every token, also under expert parallelism (the router is replicated)."""
        if self.loaded.args.moe is None or self.config.pipeline_parallel > 1:
            return []  # (a pipeline's driver holds only stage 0's layers: not counted there yet)
        from ember.model.moe import routed_tokens
        model = self.loaded.model if self.loaded.model is not None else self.runner.me.loaded.model
        return routed_tokens(model)

    @functools.cached_property
    def expert_ranks(self) -> tuple[int, ...]:
        """The rank that holds each expert (all 0 without expert parallelism); fixed at start."""
        moe = self.loaded.args.moe
        if moe is None:
            return ()
        shards = getattr(self.runner, "shards", None) if self.config.expert_parallel > 1 else None
        spans = [getattr(s, "experts", None) or s.local_experts for s in shards] if shards else None  # (EP in TP)
        return tuple(next(r for r, (a, b) in enumerate(spans) if a <= e < b) if spans else 0
                     for e in range(moe.num_experts))

    def abort(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self._draft()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        if self.on_batch is not None:
            self.on_batch(batch)
        began = time.perf_counter()
        logits, sampled = self.runner.run(batch)
        self.scheduler.step_done(batch, time.perf_counter() - began)
        self.stats.num_steps += 1
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            # a verify step's drafts count as computed once accepted (_verify)
            seq.num_computed_tokens += 1 if seq.draft_token_ids else n
            self.block_manager.register_computed(seq)
            self.stats.num_computed_tokens += n
        seqs = [batch.seqs[i] for i in sampled]  # one per logits row
        positions, previous, offset = [], None, 0  # a verify step's rows sample consecutive positions
        for i, seq in zip(sampled, seqs):
            offset = offset + 1 if i == previous else 0
            positions.append(seq.num_tokens + offset)
            previous = i
        processed = self._process_logits(logits, seqs)
        tokens = sample(processed, [s.params for s in seqs], [s.seed for s in seqs], positions)
        outputs, row = [], 0
        while row < len(seqs):
            seq = seqs[row]
            rows = range(row, row + 1 + len(seq.draft_token_ids))
            outputs.append(self._verify(seq, rows, tokens, logits) if seq.draft_token_ids else
                           self._jump_forward(seq, self._append_token(
                               seq, tokens[row], self._logprob(logits, row, tokens[row], seq))))
            row = rows.stop
        return outputs

    def _draft(self) -> None:
        """This step's drafts for every decoding sequence that speculates (prompt lookup), while few
        decode: a step's cost grows with its rows once there are more than a handful."""
        decoders = [s for s in self.scheduler.running if s.num_tokens - s.num_computed_tokens == 1]
        for seq in self.scheduler.running:
            seq.draft_token_ids = []
        if len(decoders) > self.speculative_max_batch:
            return
        for seq in decoders:
            p = seq.params
            if not p.can_speculate:
                continue
            k = self.speculative_tokens or (DEFAULT_SPECULATIVE_TOKENS if p.speculative else 0)
            # the step emits up to k + 1 tokens: no draft past max_tokens or the context length
            k = min(k, p.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens - 1)
            if k <= 0:
                continue
            if seq.drafter is None:
                seq.drafter = NgramIndex(*self.ngram_range)
            seq.draft_token_ids = seq.drafter.propose(seq.token_ids, k)

    def _verify(self, seq: Sequence, rows: range, tokens: list[int], logits: torch.Tensor) -> RequestOutput:
        """Keep the drafts that equal what was sampled at their position, then the first sampled
        token that differs (or the one after the last draft): exactly the tokens plain decoding
        would have produced, each appended (and checked for a stop) in turn."""
        drafts, seq.draft_token_ids = seq.draft_token_ids, []
        sampled = [tokens[r] for r in rows]
        accepted = accepted_prefix(drafts, sampled)
        self.stats.num_draft_tokens += len(drafts)
        self.stats.num_accepted_tokens += accepted
        outs = []
        for j in range(accepted + 1):
            outs.append(self._append_token(seq, sampled[j], self._logprob(logits, rows[j], sampled[j], seq)))
            if outs[-1].finished:
                break
            if j < accepted:  # this draft's KV was computed in the step, with the token it turned out to be
                seq.num_computed_tokens += 1
                self.block_manager.register_computed(seq)
        return self._merged(outs)

    def _jump_forward(self, seq: Sequence, out: RequestOutput) -> RequestOutput:
        """Append the tokens `seq`'s grammar forces after the one just sampled (jump-forward
        decoding, as SGLang and llguidance do), in the same output: its fixed text (a tool call's
        `<tool_call>{"name": "`, a function name once its first token settles it) costs no step per
        token; the next step computes their KV as one chunk (the scheduler's path for a running
        sequence with several tokens to compute) and samples the token after them.

        Exact: a token counts as forced only when the mask allows it alone (not EOS), and such a
        mask decides the sample whatever the logits, seed or position, so the tokens are plain
        decoding's. Each goes through `_append_token`, which advances the grammar and checks stops,
        max_tokens and the context length. Not for a request asking for logprobs (a forced token's
        would need the model's logits), and never past the blocks the pool can give the sequence
        now: a sequence waiting to compute forced tokens cannot preempt others to grow."""
        if not self.jump_forward or seq.matcher is None or seq.params.logprobs is not None or out.finished:
            return out
        outs = [out]
        while len(outs) <= JUMP_FORWARD_MAX and not outs[-1].finished and \
                self.block_manager.can_grow(seq, seq.num_tokens + 1 - seq.num_computed_tokens):
            token = self._forced_token(seq)
            if token is None:
                break
            outs.append(self._append_token(seq, token))
            self.stats.num_forced_tokens += len(outs[-1].new_token_ids)  # (none if its grammar failed)
        return self._merged(outs)

    def _forced_token(self, seq: Sequence) -> int | None:
        """The one token `seq`'s grammar allows next; None when it allows several, only EOS, or
        nothing (a failed grammar: the next step's `_append_token` ends the request)."""
        mask = np.frombuffer(seq.matcher.compute_bitmask(), dtype=np.uint32)
        words = np.flatnonzero(mask)
        if len(words) != 1:
            return None
        word = int(mask[words[0]])
        if word & (word - 1):  # more than one bit
            return None
        token = int(words[0]) * 32 + word.bit_length() - 1
        return None if token == self.eos_token_id else token

    @staticmethod
    def _merged(outs: list[RequestOutput]) -> RequestOutput:
        """One output for tokens appended in turn in one step (verified drafts, forced tokens)."""
        last = outs[-1]
        if len(outs) == 1:
            return last
        return replace(last, new_token_ids=[t for o in outs for t in o.new_token_ids],
                       new_text="".join(o.new_text for o in outs),
                       logprobs=None if last.logprobs is None else [lp for o in outs for lp in o.logprobs])

    @staticmethod
    def _logprob(logits: torch.Tensor, row: int, token: int, seq: Sequence):
        top = seq.params.logprobs
        return None if top is None else token_logprobs(logits, row, token, top)

    def _process_logits(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Logit bias, penalties and grammar masks on the rows that ask for them; `logits` itself stays
        the model's (logprobs are read from it)."""
        adjusted = [i for i, s in enumerate(seqs) if s.params.logit_bias or s.params.penalized]
        constrained = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if not adjusted and not constrained:
            return logits
        logits = torch.from_numpy(logits.numpy().copy())  # (numpy: one thread, no OpenMP wake-up)
        if adjusted:
            rows = logits[adjusted]  # (a copy: written back below)
            adjust_logits(rows, [seqs[i].params for i in adjusted], [seqs[i].output_token_ids for i in adjusted])
            logits[adjusted] = rows
        if constrained:
            bitmask = torch.zeros(len(constrained), -(-logits.shape[1] // 32), dtype=torch.int32)
            for row, i in enumerate(constrained):
                fill_mask(seqs[i].matcher, bitmask[row])
            apply_masks(logits, constrained, bitmask)
        return logits

    def _append_token(self, seq: Sequence, token: int, logprob=None) -> RequestOutput:
        p = seq.params
        if seq.matcher is not None and (seq.matcher.is_error() or (
                token != self.eos_token_id and not seq.matcher.consume_token(token))):
            return self._fail(seq, seq.matcher.get_error())  # (its mask allowed nothing, or broke)
        seq.token_ids.append(token)
        reason = None
        if (token == self.eos_token_id and not p.ignore_eos) or token in p.stop_token_ids:
            reason = "stop"
        elif seq.matcher is not None and seq.matcher.is_stopped():
            reason = "stop"  # the constrained output is complete: nothing but EOS could follow
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        new_text, stop_hit = update_text(seq, self.tokenizer.decode, final=reason is not None)
        if stop_hit:
            reason = "stop"
        if reason is not None:
            self.scheduler.finish(seq, reason)
            del self.seqs[seq.request_id]
            if seq.num_cached_tokens:
                self.stats.num_cached_prompt_tokens += seq.num_cached_tokens
        return RequestOutput(seq.request_id, [token], new_text, reason is not None, reason, seq.prompt_len,
                             seq.num_cached_tokens, seq.num_output_tokens, list(seq.block_hashes),
                             logprobs=[logprob] if logprob is not None else None)

    def _fail(self, seq: Sequence, why: str) -> RequestOutput:
        """End `seq` with finish_reason "error" (its grammar failed mid-decode, e.g. a lexer limit):
        an error for its caller, never a token outside its constraint."""
        log.warning("%s: its constraint failed while decoding: %s", seq.request_id, why)
        self.scheduler.finish(seq, "error")
        del self.seqs[seq.request_id]
        return RequestOutput(seq.request_id, [], "", True, "error", seq.prompt_len, seq.num_cached_tokens,
                             seq.num_output_tokens, list(seq.block_hashes), error=why or "grammar error")

    # -- conveniences --------------------------------------------------------------------
    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] = SamplingParams()
                 ) -> list[Completion]:
        """Run prompts to completion, batched together; results in prompt order."""
        all_params = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, all_params)]
        prompt_ids = {rid: list(self.seqs[rid].token_ids) for rid in ids}
        done: dict[str, Completion] = {}
        texts: dict[str, list[str]] = {rid: [] for rid in ids}
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        logprobs: dict[str, list] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for out in self.step():
                texts[out.request_id].append(out.new_text)
                tokens[out.request_id].extend(out.new_token_ids)
                logprobs[out.request_id].extend(out.logprobs or ())
                if out.finished:
                    done[out.request_id] = Completion(out.request_id, prompt_ids[out.request_id],
                                                      tokens[out.request_id], "".join(texts[out.request_id]),
                                                      out.finish_reason, out.cached_tokens, out.block_hashes,
                                                      logprobs[out.request_id] or None)
        return [done[rid] for rid in ids]

    def prefill(self, prompt: str | list[int], params: SamplingParams = SamplingParams()) -> Completion:
        """Prefill only: compute the prompt's KV into the cache and sample the first token."""
        return self.generate([prompt], replace(params, max_tokens=1))[0]

    # -- KV block seams (services move these bytes between sites) ------------------------------
    def export_blocks(self, block_hashes: list[bytes]) -> list[bytes]:
        """Payloads of cached blocks (layout in ember.engine.kv_cache); KeyError if one is gone."""
        payloads = []
        for h in block_hashes:
            block_id = self.block_manager.cached.get(h)
            if block_id is None:
                raise NotFoundError(f"block {h.hex()} is not in the cache (evicted or never computed)")
            payloads.append(self.cache.export_block(block_id))
        return payloads

    def export_frames(self, block_hashes: list[bytes]) -> list[bytes]:
        """Cached blocks as checksummed wire frames (ember.kv.wire), ready to leave the process."""
        return [wire.encode_frame(self.frame_template, h, payload)
                for h, payload in zip(block_hashes, self.export_blocks(block_hashes))]

    def import_blocks(self, token_ids: list[int], block_hashes: list[bytes], payloads: list[bytes | None],
                      hold: list[int] | None = None, cache_salt: bytes = b"", shared_blocks: int = 0) -> int:
        """Put the KV of the first len(block_hashes) full blocks of token_ids into the cache.

        The hashes are recomputed from the tokens and must match, so a block can never be
        filed under tokens it was not computed from. A payload of None means "already
        cached here"; if it is not (evicted meanwhile), importing stops there and the rest
        is recomputed. Returns how many blocks were new.

        With `hold`, every imported block stays referenced (its id appended to `hold`) so
        nothing can evict it before its request is admitted; the caller releases them. A
        pool with no free block then ends the import early instead of failing (the rest
        is recomputed). `cache_salt`, `shared_blocks`: the request's tenant chain.
        """
        bs = self.config.block_size
        expected = chain_hashes(token_ids[:len(block_hashes) * bs], bs, self.block_manager.root_hash,
                                salt=cache_salt, shared_blocks=shared_blocks)
        if len(expected) != len(block_hashes) or expected != list(block_hashes):
            raise IntegrityError("block hashes do not match the tokens and KV layout they claim")
        if len(payloads) != len(block_hashes):
            raise IntegrityError(f"{len(payloads)} payloads for {len(block_hashes)} blocks")
        imported = 0
        for i, (h, payload) in enumerate(zip(block_hashes, payloads)):
            block_tokens = token_ids[i * bs:(i + 1) * bs]
            if h in self.block_manager.cached:
                continue
            if payload is None:
                break
            if not self.block_manager.can_import():
                if hold is not None:
                    break
                raise CapacityError("no free KV block to import into")
            block_id = self.block_manager.reserve_for_import(h)
            try:
                self.cache.import_block(block_id, payload)
            except ValueError as e:
                self.block_manager.release(block_id)
                raise IntegrityError(str(e)) from e
            self.block_manager.publish_import(block_id, h, block_tokens, keep_ref=hold is not None)
            if hold is not None:
                hold.append(block_id)
            imported += 1
        return imported
