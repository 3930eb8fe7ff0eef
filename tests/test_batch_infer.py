"""Batch file handling: parsing, duplicate ids, resume after a torn write."""

import json

import pytest

from jaxserve.batch_infer import (DuplicateCustomIds, ResultWriter, answered_keys, parse_line,
                                  read_input, result_line)


def _req(custom_id, url="/v1/chat/completions", **body):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_parse_good_lines():
    chat = parse_line(1, _req("a"))
    assert (chat.kind, chat.custom_id, chat.error) == ("chat", "a", None)
    comp = parse_line(2, _req("b", url="/v1/completions", prompt="x"))
    assert comp.kind == "completion" and comp.body["prompt"] == "x"


@pytest.mark.parametrize("text, param", [
    ("{not json", None),
    ("[1, 2]", None),
    (json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}), "custom_id"),
    (_req("a", url="/v1/embeddings"), "url"),
    (json.dumps({"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}),
     "method"),
    (json.dumps({"custom_id": "a", "url": "/v1/completions", "body": "x"}), "body"),
    (_req("a", stream=True), "stream"),
])
def test_malformed_lines_become_400_results(text, param):
    item = parse_line(7, text)
    status, body = item.error
    assert status == 400 and body["error"]["param"] == param
    assert body["error"]["message"]


def test_duplicate_custom_ids_name_the_lines(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([_req("a"), _req("b"), "", _req("a")]) + "\n")
    with pytest.raises(DuplicateCustomIds, match=r"'a' \(lines 1 and 4\)"):
        read_input(path)


def test_resume_keys_and_torn_tail(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join([_req("a"), "{bad", _req("c")]) + "\n")
    items = read_input(inp)
    out = tmp_path / "out.jsonl"
    writer = ResultWriter(out)
    for item in items[:2]:
        writer.write(result_line(item, *(item.error or (200, {"ok": True}))))
    writer.close()
    with out.open("a") as f:  # a run killed mid-write leaves a partial line
        f.write('{"id": "batch_req_x", "custom_id": "c"')
    assert answered_keys(out) == {"id:a", "line:2"}
    assert out.read_text().endswith("\n")
    assert [i.key for i in items if i.key not in answered_keys(out)] == ["id:c"]
    assert len(out.read_text().splitlines()) == 2


def test_missing_output_means_nothing_answered(tmp_path):
    assert answered_keys(tmp_path / "none.jsonl") == set()
