"""The `code_interpreter` server tool: the model's Python run in the code sandbox
(agents/sandbox.py), its output (stdout, stderr, exit status and the files it wrote) returned as
a `code_interpreter_call` item and read by the model as JSON. Code that fails (a non-zero exit, a
signal, the wall time) is a ToolError: the model reads what went wrong and may try again.
Host side: no JAX."""

from __future__ import annotations

import json
import signal
from dataclasses import replace
from typing import Any, Iterable, Mapping

from jaxserve.agents.sandbox import SandboxLimits, SandboxResult, run_code
from jaxserve.agents.tools import ToolContext, ToolError

# Why a signal ended the code, in the terms of the limit that sends it.
SIGNAL_REASONS = {signal.SIGXCPU: "the CPU-time limit", signal.SIGXFSZ: "the file-size limit",
                  signal.SIGKILL: "a kill (a limit)", signal.SIGSEGV: "a crash (SIGSEGV)"}


class CodeInterpreter:
    kind = "code_interpreter"
    item_type = "code_interpreter_call"
    description = ("Run Python 3 code in a sandbox without network access; print results. "
                   "Files written to the current directory are returned.")

    def __init__(self, limits: SandboxLimits = SandboxLimits(),
                 tenant_limits: Mapping[str, Iterable[tuple[str, float]]] = {}):
        """`tenant_limits`: a tenant's overrides of `limits` by name (the tenants file's
        `[tenant.NAME.code_interpreter]`)."""
        self.limits = limits
        # The schema offered to the model bounds the code by the limits of whoever is offered it.
        self.parameters = {"type": "object", "properties": {"code": {
            "type": "string", "minLength": 1, "maxLength": limits.code_chars}},
            "required": ["code"], "additionalProperties": False}
        self._by_tenant = {tenant: CodeInterpreter(replace(limits, **dict(overrides)))
                           for tenant, overrides in tenant_limits.items() if overrides}

    def for_tenant(self, tenant: str) -> CodeInterpreter:
        return self._by_tenant.get(tenant, self)

    async def execute(self, context: ToolContext, arguments: dict, config: dict) -> dict:
        code = arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            raise ToolError("code_interpreter needs non-empty 'code'")
        limits = self.for_tenant(context.tenant).limits
        if len(code) > limits.code_chars:
            raise ToolError(f"the code is longer than {limits.code_chars} characters")
        try:
            result = await run_code(code, limits)
        except OSError as e:  # the runtime is missing or refused to start
            raise ToolError(f"the sandbox could not start: {e.strerror or e}") from None
        failure = _failure(result, limits)
        if failure is not None:
            raise ToolError(failure)
        return _json(result)

    def item(self, item_id: str, arguments: dict, status: str, result: Any) -> dict:
        # OpenAI's item: `outputs` holds logs (and images, which this server does not make);
        # the exit code and the files are this server's additions.
        outputs = None if result is None else [{"type": "logs", "logs": result["stdout"]}]
        return {"type": self.item_type, "id": item_id, "status": status,
                "code": arguments.get("code"), "container_id": None, "outputs": outputs,
                "result": result}

    def arguments(self, item: dict) -> dict:
        return {"code": item["code"]} if isinstance(item.get("code"), str) else {}

    def model_text(self, item: dict) -> str:
        if item.get("status") != "completed" or item.get("result") is None:
            return "error: the code did not run"
        return json.dumps(item["result"])


def _json(result: SandboxResult) -> dict:
    return {"exit_code": result.exit_code, "stdout": result.stdout, "stderr": result.stderr,
            "files": [{"name": f.name, "bytes": f.bytes, "text": f.text}
                      for f in result.files]}


def _failure(result: SandboxResult, limits: SandboxLimits) -> str | None:
    """What the model reads when its code did not end well; None when it did."""
    if result.timed_out:
        detail = f"the code ran past the wall-time limit of {limits.wall_s:g} s and was killed"
    elif result.exit_code == 0:
        return None
    elif result.signal is not None:
        try:
            reason = SIGNAL_REASONS.get(signal.Signals(result.signal),
                                        signal.Signals(result.signal).name)
        except ValueError:
            reason = f"signal {result.signal}"
        detail = f"the code was ended by {reason}"
    else:
        detail = f"the code exited with status {result.exit_code}"
    return json.dumps({"error": detail, "stdout": result.stdout, "stderr": result.stderr})
