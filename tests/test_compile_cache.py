"""--compile-cache-dir: a command that builds an engine writes its compiled programs there, and a
second run with the same model reads them back instead of adding new ones."""

from __future__ import annotations

from tests.test_cli import run_cli
from tests.test_manifest import small_vocab_gguf


def test_generate_fills_and_then_reuses_the_compile_cache(tmp_path):
    model = small_vocab_gguf(tmp_path / "tiny.gguf")
    cache = tmp_path / "xla"
    argv = ("generate", "--model", str(model), "--prompt-token-ids", "5,6,7", "--max-tokens", "3",
            "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--min-token-bucket", "16",
            "--num-pages", "16", "--compile-cache-dir", str(cache))
    first = run_cli(*argv)
    assert first.returncode == 0, first.stderr[-2000:]
    entries = sorted(p.name for p in cache.iterdir())
    assert any("forward" in name for name in entries), entries
    second = run_cli(*argv)
    assert second.returncode == 0 and second.stdout == first.stdout
    assert sorted(p.name for p in cache.iterdir()) == entries  # every program was a cache hit
    off = run_cli(*argv[:-1], "")
    assert off.returncode == 0 and sorted(p.name for p in cache.iterdir()) == entries
