"""The drain's gate: counts the calls a server is running and, once the drain notice is over,
refuses new ones with UNAVAILABLE itself.

gRPC's own `server.stop(grace)` refuses new calls too, but not reliably with UNAVAILABLE: a call
that reaches the server while it starts shutting down is CANCELLED (grpc/grpc#41785), which a
client does not retry, and a client-streaming call still running was seen cut. So the server
refuses here first, waits for the running calls to end, and only then stops gRPC."""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import time

import grpc
from grpc_health.v1 import health

# Health answers through the drain (NOT_SERVING), and neither a health Watch nor a reflection
# stream (a client such as grpcurl may hold one open) counts as running work.
UNGATED = (f"/{health.SERVICE_NAME}/", "/grpc.reflection.")


class DrainGate(grpc.aio.ServerInterceptor):
    """Server interceptor: `running` calls in flight; after `close()` new calls are refused."""

    def __init__(self):
        self.running = 0
        self.closed = False
        self._changed: asyncio.Event | None = None  # made on the server's loop, at first use

    def close(self) -> None:
        self.closed = True

    async def idle(self, timeout_s: float) -> bool:
        """Wait until no call runs (True) or `timeout_s` passes (False)."""
        deadline = time.monotonic() + timeout_s
        while self.running:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            changed = self._event()
            changed.clear()
            try:
                await asyncio.wait_for(changed.wait(), left)
            except TimeoutError:
                return False
        return True

    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _started(self, context) -> None:
        """Count a call until gRPC is done with it: its status sent, or it was cancelled (not
        merely its handler returned: the reply is sent after that)."""
        self.running += 1
        context.add_done_callback(self._ended)

    def _ended(self, _context) -> None:
        self.running -= 1
        self._event().set()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(UNGATED):
            return handler
        gate = self

        async def refuse(context):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is draining (shutting down); retry elsewhere")

        def unary(fn):  # (also a streaming handler that is a coroutine writing to its context)
            async def counted(request, context):
                if gate.closed:
                    await refuse(context)
                gate._started(context)
                return await fn(request, context)
            return counted

        def stream(fn):
            async def counted(request, context):
                if gate.closed:
                    await refuse(context)
                gate._started(context)
                # aclosing: a stream the client ends closes the handler now
                async with contextlib.aclosing(fn(request, context)) as items:
                    async for item in items:
                        yield item
            return counted

        kinds = (("unary_unary", grpc.unary_unary_rpc_method_handler),
                 ("stream_unary", grpc.stream_unary_rpc_method_handler),
                 ("unary_stream", grpc.unary_stream_rpc_method_handler),
                 ("stream_stream", grpc.stream_stream_rpc_method_handler))
        for kind, make in kinds:
            fn = getattr(handler, kind)
            if fn is not None:  # (a streaming handler may also be a coroutine writing to its context)
                wrap = stream if inspect.isasyncgenfunction(fn) else unary
                return make(wrap(fn), handler.request_deserializer, handler.response_serializer)
        return handler
