"""The code_interpreter tool's sandbox (bubblewrap) against the escape list: each attempt is
contained, reported to the model as a tool error or a clean result, and the host unaffected.
Executor level: the real bwrap runs the code; no model."""

import argparse
import asyncio
import json
import os
import shutil
import socket
import tempfile
import time
from dataclasses import fields, replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from jaxserve.agents.code_interpreter import CodeInterpreter
from jaxserve.agents.run import Run, TurnResult
from jaxserve.agents.sandbox import SandboxLimits
from jaxserve.agents.tools import ToolContext, ToolError
from jaxserve.entrypoints.serving.request_models import request_models
from jaxserve.entrypoints.serving.response_models import OutputCodeInterpreterCall
from jaxserve.entrypoints.serving.validation import validate
from jaxserve.errors import ConfigError, InvalidRequest
from jaxserve.gateway.tenants import CODE_LIMITS, load_tenants

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is absent")

REPO = Path(__file__).resolve().parents[1]
CONTEXT = ToolContext("tenant-a", "resp_test", "resp_test.step001", None)
# Small limits: every case ends in about two seconds at most.
LIMITS = SandboxLimits(wall_s=3.0, cpu_s=1, memory_bytes=256 * 1024 * 1024, processes=8,
                       file_bytes=1024 * 1024, output_bytes=1000)


@pytest.fixture
def tool():
    # Not under tmp_path: its parents are private to root, and a root server's sandbox runs as
    # nobody, who must reach its directory (docs/agents.md: `workdir`).
    workdir = Path(tempfile.mkdtemp(prefix="jaxserve-test-runs-"))
    workdir.chmod(0o755)
    yield CodeInterpreter(replace(LIMITS, workdir=str(workdir)))
    # The host is unaffected: nothing of any sandbox outlives its run, not even its directory.
    assert list(workdir.iterdir()) == []
    workdir.rmdir()
    assert _processes_mentioning(str(workdir)) == []
    if os.geteuid() == 0:  # a sandbox's pid 1 may take a moment to exit after its child
        deadline = time.monotonic() + 1
        while _processes_of(LIMITS.run_as_uid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _processes_of(LIMITS.run_as_uid) == []


def run(tool, code):
    return asyncio.run(tool.execute(CONTEXT, {"code": code}, {"type": "code_interpreter"}))


def timed_error(tool, code) -> tuple[str, float]:
    started = time.monotonic()
    with pytest.raises(ToolError) as e:
        run(tool, code)
    return str(e.value), time.monotonic() - started


def test_a_script_runs_and_its_files_come_back(tool):
    result = run(tool, "import os\nopen('out.txt', 'w').write('hello from the sandbox')\n"
                       "os.mkdir('sub'); open('sub/data.bin', 'wb').write(bytes(range(256)))\n"
                       "print(sum(range(10)))")
    assert result["exit_code"] == 0 and result["stdout"] == "45\n"
    assert result["files"] == [
        {"name": "out.txt", "bytes": 22, "text": "hello from the sandbox"},
        {"name": "sub/data.bin", "bytes": 256, "text": None}]
    item = tool.item("ci_1", {"code": "print(1)"}, "completed", result)
    assert item["outputs"] == [{"type": "logs", "logs": "45\n"}]
    assert '"exit_code": 0' in tool.model_text(item)


def test_many_files_and_odd_ones_come_back_bounded(tool):
    result = run(tool, "import os\nos.mkfifo('fifo')\nos.symlink('/', 'root')\n"
                       "for i in range(200):\n    open(f'f{i:03d}', 'w').write('x' * 5000)")
    names = [f["name"] for f in result["files"]]
    assert 0 < len(names) <= LIMITS.max_files and "fifo" not in names and "root" not in names
    assert all(f["bytes"] == 5000 and f["text"] is None for f in result["files"])


def test_bad_code_is_a_tool_error(tool):
    message, _ = timed_error(tool, "print('before')\nraise ValueError('boom')")
    assert "exited with status 1" in message and "ValueError: boom" in message
    assert "before" in message
    with pytest.raises(ToolError):
        run(tool, "   ")


def test_no_network(tool):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        result = run(tool, f"""
import socket
for address in [("127.0.0.1", {port}), ("1.1.1.1", 53), ("8.8.8.8", 443)]:
    s = socket.socket()
    s.settimeout(1)
    try:
        s.connect(address)
        print("connected", address)
    except OSError as e:
        print("blocked", e.errno)
""")
        with pytest.raises(BlockingIOError):
            listener.accept()  # the host's listener saw nothing
    finally:
        listener.close()
    assert "connected" not in result["stdout"]
    assert result["stdout"].count("blocked") == 3


def test_nothing_outside_the_run_directory_is_readable(tool, tmp_path, monkeypatch):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "keys.json").write_text("SECRET-KEY-123")
    monkeypatch.setenv("JAXSERVE_TEST_TOKEN", "SECRET-ENV-456")
    targets = [str(data_dir / "keys.json"), str(data_dir), "/root", str(REPO / ".git" / "HEAD"),
               str(REPO / "pyproject.toml"), "/etc/shadow", "/etc/passwd"]
    result = run(tool, f"""
import os
for path in {targets!r}:
    try:
        print("GOT:", path, open(path).read() if os.path.isfile(path) else os.listdir(path))
    except OSError as e:
        print("denied", path, type(e).__name__)
print(dict(os.environ))
# A link to a host file, left for the server to read back: it must not follow it.
os.symlink({str(data_dir / "keys.json")!r}, "link.txt")
""")
    assert "GOT:" not in result["stdout"]
    assert result["stdout"].count("denied") == len(targets)
    assert "SECRET" not in result["stdout"]
    assert all(f["name"] != "link.txt" for f in result["files"])


def test_the_system_is_read_only(tool):
    result = run(tool, """
for path in ["/usr/evil", "/usr/bin/python3"]:
    try:
        open(path, "a").write("x")
        print("WROTE", path)
    except OSError as e:
        print("denied", type(e).__name__)
""")
    assert "WROTE" not in result["stdout"] and result["stdout"].count("denied") == 2


def test_a_fork_bomb_is_bounded_and_ends(tool):
    # Holding its children, the code gets no more processes than the limit.
    result = run(tool, """
import os, time
n = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(5)
            os._exit(0)
        n += 1
except OSError as e:
    print(n, e.errno, flush=True)
    os._exit(0)
""")
    forked = int(result["stdout"].split()[0])
    assert 0 < forked < LIMITS.processes
    # The classic bomb: it ends (each copy dies of its own failed fork, or the wall time).
    started = time.monotonic()
    try:
        run(tool, "import os\nwhile True:\n    os.fork()")
    except ToolError:
        pass
    assert time.monotonic() - started < LIMITS.wall_s + 1.5


def test_a_memory_bomb_is_bounded(tool):
    message, elapsed = timed_error(tool, "x = bytearray(1024 * 1024 * 1024)")
    assert "MemoryError" in message
    message, elapsed = timed_error(tool, "x = []\nwhile True:\n    x.append(b'1' * 10**7)")
    assert "MemoryError" in message and elapsed < 5


def test_an_infinite_loop_is_killed_at_the_cpu_limit(tool):
    # A wall time well past the CPU limit: on a loaded host a CPU second takes longer.
    tool = CodeInterpreter(replace(tool.limits, wall_s=8))
    message, elapsed = timed_error(tool, "while True:\n    pass")
    assert "CPU-time limit" in message
    assert elapsed < LIMITS.cpu_s + 4


def test_a_sleeping_loop_is_killed_at_the_wall_time(tool):
    tool = CodeInterpreter(replace(tool.limits, wall_s=1.5))
    message, elapsed = timed_error(tool, "import time\nprint('started', flush=True)\n"
                                         "while True:\n    time.sleep(1)")
    assert "wall-time limit of 1.5 s" in message and "started" in message
    assert 1.5 <= elapsed < 4


def test_a_huge_output_is_truncated(tool):
    result = run(tool, "import sys\nsys.stdout.write('x' * 10_000_000)\n"
                       "sys.stderr.write('y' * 3000)")
    assert result["stdout"] == "x" * 1000 + "\n[... truncated: 9999000 more bytes]"
    assert result["stderr"].startswith("y" * 1000 + "\n[... truncated: 2000 more bytes]")


def test_a_huge_file_is_bounded(tool):
    message, _ = timed_error(tool, "open('big', 'wb').write(b'0' * 10 * 1024 * 1024)")
    assert "File too large" in message or "file-size limit" in message


def test_a_cancelled_run_frees_its_sandbox_within_a_second(tool):
    async def cancel():
        task = asyncio.create_task(tool.execute(CONTEXT, {"code": "import time\n"
                                                          "time.sleep(30)"}, {}))
        await asyncio.sleep(0.3)
        started = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.monotonic() - started

    assert asyncio.run(cancel()) < 1


def test_the_command_is_a_setting(tmp_path):
    limits = replace(LIMITS, command=("runsc", "--network=none", "do", "--cwd", "{rundir}",
                                      "{python}", "-"), workdir=str(tmp_path))
    assert limits.argv("/r") == ["runsc", "--network=none", "do", "--cwd", "/r",
                                 "/usr/bin/python3", "-"]
    assert "--cpu=1:2" in LIMITS.argv("/r") and "--nproc=8" in LIMITS.argv("/r")


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if text.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    return found


def _processes_of(uid: int) -> list[int]:
    """Live ones: an ended sandbox's pid-1 may wait a moment as a zombie for init to reap it."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if os.stat(f"/proc/{pid}").st_uid == uid and state != "Z":
                found.append(int(pid))
        except OSError:
            pass
    return found


def test_the_responses_api_types_the_tool():
    models = request_models()
    body = {"model": "m", "input": "hi", "tools": [
        {"type": "code_interpreter", "container": {"type": "auto"}}],
        "tool_choice": {"type": "code_interpreter"}}
    req = validate(models.responses, body)
    assert req.tools[0].model_dump(exclude_none=True) == {"type": "code_interpreter",
                                                         "container": {"type": "auto"}}
    assert req.tool_choice.type == "code_interpreter"
    # A named (persistent) container is not served: a 400 naming the field.
    with pytest.raises(InvalidRequest) as e:
        validate(models.responses, {**body, "tools": [{"type": "code_interpreter",
                                                       "container": "cntr_123"}]})
    assert "container" in str(e.value)


def test_a_run_feeds_the_sandbox_s_error_and_result_back_to_the_model(tool):
    """Through the run machinery (agents/run.py): scripted model turns call the tool, the first
    with code that fails, the second with code that works; the model reads each outcome."""
    codes = ["1/0", "print(6 * 7)"]
    seen = []

    async def turns(items, tool_texts, tools_allowed):
        seen.append(dict(tool_texts))
        if tools_allowed and codes:
            return TurnResult([{"type": "function_call", "id": "fc", "call_id": "c",
                                "name": "code_interpreter", "status": "completed",
                                "arguments": json.dumps({"code": codes.pop(0)})}],
                              {}, "tool_calls")
        return TurnResult([{"type": "message", "id": "msg", "role": "assistant",
                            "status": "completed", "content": []}], {}, "stop")

    config = {"type": "code_interpreter", "container": {"type": "auto"}}
    run = Run("r", "acme", None, {"code_interpreter": (tool, config)}, turns)
    result = asyncio.run(run.execute([]))
    failed, done = result.output[0], result.output[1]
    assert (failed["status"], done["status"]) == ("failed", "completed")
    assert "ZeroDivisionError" in seen[1][failed["id"]]
    assert json.loads(seen[2][done["id"]])["stdout"] == "42\n"
    for item in (failed, done):  # the Responses API's output item type holds both
        OutputCodeInterpreterCall.model_validate(item)


def test_the_serve_flag_offers_the_tool_with_each_tenant_s_limits(tmp_path):
    """--code-interpreter reaches the server's tool registry (off by default), with the limits
    of a tenant's [tenant.NAME.code_interpreter] table over the defaults."""
    from jaxserve.entrypoints.http.responses_routes import _server_tools
    from jaxserve.entrypoints.launcher import add_serve_arguments, server_config

    path = tmp_path / "tenants.toml"
    path.write_text('[tenant.acme]\napi_keys = ["sk-acme-0123456789abcdefghijkl"]\n'
                    '[tenant.acme.code_interpreter]\nwall_s = 1.5\nprocesses = 4\ncode_chars = 64\n'
                    '[tenant.other]\napi_keys = ["sk-other-0123456789abcdefghijk"]\n')
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    state = SimpleNamespace(serving=SimpleNamespace(rag=None),
                            gateway=SimpleNamespace(tenants=load_tenants(path)))
    state.config = server_config(parser.parse_args([]))
    assert _server_tools(state) == ()
    state.config = server_config(parser.parse_args(["--code-interpreter"]))
    (tool,) = _server_tools(state)
    assert tool.kind == "code_interpreter" and tool.limits == SandboxLimits()
    acme = tool.for_tenant("acme")
    assert acme.limits == replace(SandboxLimits(), wall_s=1.5, processes=4, code_chars=64)
    assert acme.parameters["properties"]["code"]["maxLength"] == 64
    assert tool.for_tenant("other") is tool
    assert tool.parameters["properties"]["code"]["maxLength"] == SandboxLimits().code_chars
    long_code = "print(1)\n" * 10  # 90 characters: over acme's 64, not the default's
    with pytest.raises(ToolError, match="longer than 64 characters"):
        asyncio.run(tool.execute(replace(CONTEXT, tenant="acme"), {"code": long_code}, {}))
    assert asyncio.run(tool.execute(CONTEXT, {"code": long_code}, {}))["exit_code"] == 0
    started = time.monotonic()
    with pytest.raises(ToolError, match="wall-time limit of 1.5 s"):
        asyncio.run(tool.execute(replace(CONTEXT, tenant="acme"), {"code": "import time\n"
                                                                   "time.sleep(30)"}, {}))
    assert time.monotonic() - started < 4


def test_a_tenant_s_limits_are_checked_where_the_file_is_read(tmp_path):
    assert set(CODE_LIMITS) <= {f.name for f in fields(SandboxLimits)}
    path = tmp_path / "tenants.toml"
    for table, field in (("python = '/bin/sh'", "python"), ("wall_s = -1", "wall_s"),
                         ("processes = 1.5", "processes")):
        path.write_text('[tenant.acme]\napi_keys = ["sk-acme-0123456789abcdefghijkl"]\n'
                        f'[tenant.acme.code_interpreter]\n{table}\n')
        with pytest.raises(ConfigError, match=field):
            load_tenants(path)
