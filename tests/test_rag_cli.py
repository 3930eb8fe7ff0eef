"""`jaxserve index` and `jaxserve search` in process, on the real encoder."""

from __future__ import annotations

import json

import pytest

from jaxserve.entrypoints.cli import main
from jaxserve.rag.config import RagConfig
from jaxserve.rag.service import RagService

pytestmark = pytest.mark.slow


def test_index_then_search(tmp_path, capsys):
    (tmp_path / "notes.md").write_text("# Baking\n\nKnead the dough, then let the bread rise.\n")
    (tmp_path / "facts.jsonl").write_text(
        json.dumps({"id": "fr", "text": "Paris is the capital of France."}) + "\n\n"
        + json.dumps({"id": "de", "text": "Berlin is the capital of Germany.",
                      "metadata": {"src": "atlas"}}) + "\n")
    data = str(tmp_path / "data")
    assert main(["index", "--collection", "kb", "--data-dir", data, "--no-progress",
                 str(tmp_path / "notes.md"), str(tmp_path / "facts.jsonl")]) == 0
    assert "indexed 3 documents (3 chunks) into kb" in capsys.readouterr().out

    assert main(["search", "--collection", "kb", "--data-dir", data, "--json", "--top-k", "2",
                 "--mode", "dense", "What is the capital city of Germany?"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert [r["document_id"] for r in results][0] == "de"
    assert results[0]["metadata"] == {"source": str(tmp_path / "facts.jsonl"), "src": "atlas"}

    assert main(["search", "--collection", "kb", "--data-dir", data, "how to bake bread"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith(f"{tmp_path / 'notes.md'}#0")

    # Indexing again upserts: same ids, no duplicates.
    assert main(["index", "--collection", "kb", "--data-dir", data, "--no-progress",
                 str(tmp_path / "facts.jsonl")]) == 0
    capsys.readouterr()
    assert main(["search", "--collection", "kb", "--data-dir", data, "--json", "--top-k", "10",
                 "capital"]) == 0
    assert len(json.loads(capsys.readouterr().out)["results"]) == 3

    # --tenant: the new collection is that tenant's (as the server's routes see it), and
    # another tenant cannot index into it.
    facts = str(tmp_path / "facts.jsonl")
    assert main(["index", "--collection", "theirs", "--tenant", "bob", "--data-dir", data,
                 "--no-progress", facts]) == 0
    capsys.readouterr()
    service = RagService(RagConfig(tmp_path / "data"))
    assert (service.list_collections("bob"), service.owner("kb")) == (["theirs"], "default")
    assert main(["index", "--collection", "theirs", "--tenant", "alice", "--data-dir", data,
                 "--no-progress", facts]) == 1
    assert capsys.readouterr().err == "error: collection 'theirs' exists already\n"


def test_user_errors_are_one_line(tmp_path, capsys):
    data = str(tmp_path / "data")
    (tmp_path / "image.png").write_bytes(b"\x89PNG")
    assert main(["search", "--collection", "none", "--data-dir", data, "q"]) == 1
    assert capsys.readouterr().err == "error: collection 'none' does not exist\n"
    assert main(["index", "--collection", "kb", "--data-dir", data,
                 str(tmp_path / "image.png")]) == 1
    assert "unsupported file type" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"id": "x"}\n')
    assert main(["index", "--collection", "kb", "--data-dir", data, "--no-progress",
                 str(tmp_path / "bad.jsonl")]) == 1
    assert "bad.jsonl:1.text must be a string" in capsys.readouterr().err
    assert main(["index", "--collection", "kb", "--data-dir", data, "--tenant", "a b",
                 str(tmp_path / "bad.jsonl")]) == 1
    assert capsys.readouterr().err.startswith("error: --tenant: must be a name")
