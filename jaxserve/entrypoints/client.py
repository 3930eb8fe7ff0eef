"""Small gRPC clients for a jaxserve server: AsyncClient (grpc.aio) and Client (blocking).

Both stream GenerateResponse deltas; `timeout` is the request deadline, and the server aborts
the generation (freeing its KV pages) when it expires. With `root_certificates` (PEM bytes of the
CA that signed the server's certificate) they connect over TLS (a server started with
--ssl-certfile); without, in plain text."""

from __future__ import annotations

from typing import AsyncIterator, Iterator

import grpc

from jaxserve.protos import generation_pb2 as pb
from jaxserve.protos import generation_pb2_grpc as pb_grpc


def generate_request(model: str, prompt: str | list[int], **sampling) -> pb.GenerateRequest:
    """A GenerateRequest from a text or token-id prompt and keyword sampling fields."""
    if isinstance(prompt, str):
        return pb.GenerateRequest(model=model, prompt=prompt, **sampling)
    return pb.GenerateRequest(model=model, prompt_token_ids=prompt, **sampling)


def _credentials(root_certificates: bytes | None) -> grpc.ChannelCredentials | None:
    return (grpc.ssl_channel_credentials(root_certificates) if root_certificates is not None
            else None)


class AsyncClient:
    def __init__(self, target: str, root_certificates: bytes | None = None):
        creds = _credentials(root_certificates)
        self.channel = (grpc.aio.secure_channel(target, creds) if creds
                        else grpc.aio.insecure_channel(target))
        self.stub = pb_grpc.GenerationStub(self.channel)

    def generate(self, model: str, prompt: str | list[int], *, timeout: float | None = None,
                 **sampling) -> AsyncIterator[pb.GenerateResponse]:
        return self.stub.Generate(generate_request(model, prompt, **sampling), timeout=timeout)

    async def complete(self, model: str, prompt: str | list[int], *,
                       timeout: float | None = None, **sampling) -> pb.GenerateResponse:
        """The whole generation joined into one response (text, token_ids, logprobs,
        prompt_logprobs, finish_reason, usage)."""
        return _join([r async for r in self.generate(model, prompt, timeout=timeout, **sampling)])

    async def list_models(self) -> list[pb.Model]:
        return list((await self.stub.ListModels(pb.ListModelsRequest())).models)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()


class Client:
    def __init__(self, target: str, root_certificates: bytes | None = None):
        creds = _credentials(root_certificates)
        self.channel = (grpc.secure_channel(target, creds) if creds
                        else grpc.insecure_channel(target))
        self.stub = pb_grpc.GenerationStub(self.channel)

    def generate(self, model: str, prompt: str | list[int], *, timeout: float | None = None,
                 **sampling) -> Iterator[pb.GenerateResponse]:
        return self.stub.Generate(generate_request(model, prompt, **sampling), timeout=timeout)

    def complete(self, model: str, prompt: str | list[int], *, timeout: float | None = None,
                 **sampling) -> pb.GenerateResponse:
        return _join(list(self.generate(model, prompt, timeout=timeout, **sampling)))

    def list_models(self) -> list[pb.Model]:
        return list(self.stub.ListModels(pb.ListModelsRequest()).models)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _join(deltas: list[pb.GenerateResponse]) -> pb.GenerateResponse:
    joined = pb.GenerateResponse(text="".join(d.text for d in deltas),
                                 token_ids=[t for d in deltas for t in d.token_ids],
                                 logprobs=[lp for d in deltas for lp in d.logprobs],
                                 prompt_logprobs=[lp for d in deltas for lp in d.prompt_logprobs])
    if deltas:
        joined.finish_reason = deltas[-1].finish_reason
        joined.usage.CopyFrom(deltas[-1].usage)
    return joined
