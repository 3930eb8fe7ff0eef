"""Scheduler + page pool driven by a fake runner.

The fake runner keeps a "KV cache" of token ids, writes each step's tokens through `slot_mapping`,
and predicts the next token as a hash of the sequence's history READ BACK FROM THAT CACHE through
`page_indices` / `kv_lens`. So a wrong page, slot, position, shared prefix page or recompute after
preemption changes the outputs, which are compared with the same hash over the plain token list.
"""

from __future__ import annotations

import itertools
import sys
import zlib
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from jaxserve.executor.batch_plan import next_power_of_two, pages_for
from jaxserve.config import CacheConfig, ModelConfig, SchedulerConfig
from jaxserve.errors import ConfigError
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler import Scheduler
from jaxserve.engine_settings import make_engine_config

VOCAB = 50
_WEIGHTS = np.array([pow(31, i, 1_000_003) for i in range(512)], np.int64)


def next_token(history) -> int:
    h = np.asarray(history, np.int64)
    return int((h * _WEIGHTS[:len(h)]).sum() * 2654435761 % 1_000_003 % VOCAB)


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


class FakeRunner:
    def __init__(self, num_pages: int, page_size: int):
        self.kv = np.full((num_pages, page_size), -1, np.int64)

    def step(self, plan) -> np.ndarray:
        """One predicted token per logits row, from the history up to that row's position."""
        s_live = int(plan.num_seqs[0])
        self.kv.reshape(-1)[plan.slot_mapping] = plan.token_ids  # padding rows hit the null page
        for s in range(s_live):
            lo, hi, kv_len = plan.cu_q_lens[s], plan.cu_q_lens[s + 1], plan.kv_lens[s]
            assert list(plan.positions[lo:hi]) == list(range(kv_len - (hi - lo), kv_len))
        out = np.zeros(len(plan.logits_indices), np.int64)
        for i, flat in enumerate(plan.logits_indices):
            s = int(np.searchsorted(plan.cu_q_lens[1:s_live + 1], flat, side="right"))
            if s < s_live:
                history = self.kv[plan.page_indices[s]].reshape(-1)[:plan.positions[flat] + 1]
                out[i] = next_token(history)
        return out


def corrupting_oracle(k: int):
    """A drafter proposing the reference continuation, with about a third of its drafts wrong
    (fixed by the request and position), so steps see drafts that stand and drafts that fall."""
    def drafter(request: Request, n: int) -> list[int]:
        done = len(request.output_token_ids)
        truth = reference(request.prompt_token_ids, done + min(n, k))[done:]
        return [(t + 1) % VOCAB if zlib.crc32(f"{request.request_id}:{done + j}".encode()) % 3 == 0
                else t for j, t in enumerate(truth)]
    return drafter


@dataclass
class Clock:
    """The scheduler's clock in tests: one unit per step (Run.step advances it)."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Run:
    """Drives a scheduler like the engine does; records what tests assert on."""

    sched: Scheduler
    max_tokens: dict[str, int]
    clock: Clock = None
    runner: FakeRunner = None
    ends: dict[str, list[RequestStatus]] = field(default_factory=dict)
    requests: dict[str, Request] = field(default_factory=dict)
    steps: list = field(default_factory=list)  # per step: list of (request_id, n, was_decode)
    preemptions: list[str] = field(default_factory=list)  # request ids, in order
    before_update: object = None  # called between schedule() and update_from_output()

    def __post_init__(self):
        self.runner = FakeRunner(self.sched.cache.num_pages, self.sched.page_size)
        self.clock = self.sched.clock

    def add(self, request: Request, max_tokens: int) -> None:
        self.requests[request.request_id] = request
        self.max_tokens[request.request_id] = max_tokens
        self.sched.add_request(request)

    def end(self, request: Request) -> None:
        self.ends.setdefault(request.request_id, []).append(request.status)

    def finish(self, request_id: str, status: RequestStatus) -> bool:
        ok = self.sched.finish_request(request_id, status)
        if ok:
            self.end(self.requests[request_id])
        return ok

    def step(self) -> bool:
        cfg, sched = self.sched.config, self.sched
        decoding_before = {r.request_id for r in sched.running
                           if r.num_tokens - r.num_computed_tokens == 1}
        out = sched.schedule()
        for r in sched.take_finished():
            self.end(r)
        now = self.clock.now
        for r in list(sched.running) + list(sched.waiting):  # nothing expired is left
            assert r.deadline is None or r.deadline > now, r.request_id
            assert (r.queue_deadline is None or r.queue_deadline > now
                    or r.status != RequestStatus.WAITING), r.request_id
        self.clock.now += 1
        if out is None:
            assert not sched.has_unfinished(), "livelock: requests left but nothing scheduled"
            return False
        rows = [(s.request.request_id, s.num_tokens, s.request.request_id in decoding_before)
                for s in out.scheduled]
        self.steps.append(rows)
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert len(out.scheduled) <= cfg.max_num_seqs
        assert len({rid for rid, _, _ in rows}) == len(rows), "a request scheduled twice"
        kinds = [was_decode for _, _, was_decode in rows]
        assert kinds == sorted(kinds, reverse=True), "a prefill row precedes a decode row"
        preempted = {r.request_id for r in out.preempted}
        self.preemptions += [r.request_id for r in out.preempted]
        assert not preempted & {rid for rid, _, _ in rows}, "preempted and scheduled in one step"
        assert decoding_before <= {rid for rid, _, _ in rows} | preempted | set(self.ends), \
            "a running decode was neither scheduled nor preempted"
        for s in out.scheduled:
            remaining = s.request.num_tokens - s.request.num_computed_tokens
            assert 1 <= s.num_tokens <= remaining and s.samples == (s.num_tokens == remaining)
            assert not s.draft_token_ids or (s.num_tokens == 1 and s.samples and len(
                s.draft_token_ids) <= sched.num_speculative_tokens), "drafts off a decode"
        assert sum(s.num_rows for s in out.scheduled) <= len(out.plan.logits_indices)
        sampled = self.runner.step(out.plan)
        if self.before_update is not None:
            self.before_update(self)
        for request, tokens in sched.update_from_output(out, sampled):
            assert tokens and len(request.output_token_ids) <= self.max_tokens[request.request_id]
            if len(request.output_token_ids) >= self.max_tokens[request.request_id]:
                self.finish(request.request_id, RequestStatus.FINISHED_LENGTH)
        sched.cache.check_invariants()
        return True

    def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.step():
                break
        assert not self.sched.has_unfinished()
        self.check_drained()

    def check_drained(self) -> None:
        cache = self.sched.cache
        cache.check_invariants()
        assert cache.num_pages_in_use == 0 and cache.num_free_pages == cache.num_usable_pages
        assert all(len(v) == 1 for v in self.ends.values()), self.ends
        assert set(self.ends) == set(self.requests), "a request never ended"


def make(num_pages=64, page_size=4, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128,
         prefix=True, chunked=True, speculative_tokens=0) -> Run:
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len, enable_chunked_prefill=chunked),
                      CacheConfig(page_size=page_size, enable_prefix_caching=prefix), num_pages,
                      clock=Clock(),
                      drafter=corrupting_oracle(speculative_tokens) if speculative_tokens else None,
                      num_speculative_tokens=speculative_tokens)
    return Run(sched, {})


def prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, VOCAB, n)]


# ---- targeted behaviours ---------------------------------------------------------------------


def test_outputs_match_reference():
    run = make()
    for i in range(6):
        run.add(Request(f"r{i}", prompt(i, 3 + 7 * i)), max_tokens=5)
    run.run()
    for rid, r in run.requests.items():
        assert r.output_token_ids == reference(r.prompt_token_ids, 5), rid
        assert run.ends[rid] == [RequestStatus.FINISHED_LENGTH]


def test_speculation_keeps_outputs_and_takes_only_spare_room():
    """Drafts stand up to the first wrong one and the model's own token follows (outputs equal
    the reference, which the fake runner reads back through the pages, so a rejected draft's
    K/V left where the next token must overwrite it would show); drafts only fill a step up to
    16 tokens (DRAFT_ROOM_TOKENS; a full step gets none) and never pass max_tokens."""
    run = make(num_pages=64, page_size=4, max_num_seqs=8, max_num_batched_tokens=32,
               speculative_tokens=3)
    for i in range(6):
        run.add(Request(f"r{i}", prompt(i, 3 + 5 * i), max_tokens=7 + i), max_tokens=7 + i)
    drafts_by_step = []
    while True:
        out = run.sched.schedule()
        if out is None:
            break
        plain = sum(s.num_tokens for s in out.scheduled)
        drafts = sum(len(s.draft_token_ids) for s in out.scheduled)
        # The step's own bucket, drafts included; drafts fill at most the room of 16 tokens or
        # of the bucket the plain step needs anyway.
        assert len(out.plan.token_ids) == next_power_of_two(plain + drafts)
        assert plain + drafts <= max(16, next_power_of_two(plain))
        drafts_by_step.append((plain, drafts))
        for s in out.scheduled:
            r = s.request
            assert len(r.output_token_ids) + s.num_rows <= run.max_tokens[r.request_id]
        for request, _ in run.sched.update_from_output(out, run.runner.step(out.plan)):
            if len(request.output_token_ids) >= run.max_tokens[request.request_id]:
                run.finish(request.request_id, RequestStatus.FINISHED_LENGTH)
        run.sched.cache.check_invariants()
    run.check_drained()
    for rid, r in run.requests.items():
        assert r.output_token_ids == reference(r.prompt_token_ids, run.max_tokens[rid]), rid
    stats = run.sched.stats()
    assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens
    assert any(plain == 32 for plain, _ in drafts_by_step)  # full steps happened, without drafts
    assert any(plain < 16 and drafts for plain, drafts in drafts_by_step)
    assert sum(drafts for _, drafts in drafts_by_step) == stats.num_draft_tokens


def test_deterministic_cuts_a_prompt_at_the_same_places_in_any_batch():
    """--deterministic: one token bucket, and a prompt's prefill chunks end at multiples of
    max_num_batched_tokens - max_num_seqs + 1 (here 29) whatever else runs; outputs unchanged."""
    def chunks_of_p(others: int) -> tuple[list[int], set]:
        sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32,
                                          max_model_len=128, deterministic=True),
                          CacheConfig(page_size=4, enable_prefix_caching=False), 96,
                          clock=Clock())
        run = Run(sched, {})
        for i in range(others):  # decodes and other prompts sharing p's steps
            run.add(Request(f"o{i}", prompt(10 + i, 5 + 9 * i)), max_tokens=6)
        run.add(Request("p", prompt(1, 70)), max_tokens=3)
        run.run()
        for rid, r in run.requests.items():
            assert r.output_token_ids == reference(r.prompt_token_ids, run.max_tokens[rid])
        assert sched.shapes.token_buckets == (32,)
        return [n for rows in run.steps for rid, n, decode in rows if rid == "p" and not decode]

    alone = chunks_of_p(0)
    assert alone == [29, 29, 12]
    for others in (1, 3):
        assert chunks_of_p(others) == alone
    # Prefix caching defaults to off with it (a hit would move the chunks); on, or speculation,
    # beside it is an error.
    model = ModelConfig("m", 64, 32, 64, 2, 4, 2, 8, max_position_embeddings=128)
    config = make_engine_config(model, {"deterministic": True})
    assert config.scheduler.deterministic and not config.cache.enable_prefix_caching
    for clash in ({"enable_prefix_caching": True}, {"speculative_ngram": 2}):
        with pytest.raises(ConfigError, match="deterministic mode"):
            make_engine_config(model, {"deterministic": True, **clash})


def test_plan_shapes_come_from_the_buckets():
    run = make(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=40, page_size=4)
    run.add(Request("a", prompt(0, 20)), 2)
    out = run.sched.schedule()
    assert out.plan.token_ids.shape == (32,)  # 20 tokens -> bucket 32
    assert out.plan.kv_lens.shape == (4,)  # min(32, next_pow2(max_num_seqs))
    assert out.plan.page_indices.shape == (4, 10)  # ceil(max_model_len / page_size)
    assert [(s.num_tokens, s.samples) for s in out.scheduled] == [(20, True)]
    run.sched.update_from_output(out, [7])
    out = run.sched.schedule()  # a lone decode: the 1-token bucket, one sequence, one row
    assert [len(a) for a in (out.plan.token_ids, out.plan.kv_lens, out.plan.logits_indices)] == [
        1, 1, 1]


def test_chunked_prefill_splits_a_long_prompt_while_decodes_keep_flowing():
    run = make(max_num_batched_tokens=16, max_num_seqs=4)
    run.add(Request("short", prompt(1, 4)), max_tokens=20)
    run.step()  # short prefilled; it decodes from now on
    run.add(Request("long", prompt(2, 100)), max_tokens=2)
    run.run()
    long_chunks = [n for rows in run.steps for rid, n, _ in rows if rid == "long"]
    assert sum(long_chunks[:-1]) == 100 and len(long_chunks) >= 7  # >= 100 / 15 prefill steps
    assert max(long_chunks) <= 15  # the short request's decode took one token of each step
    for rows in run.steps[1:len(long_chunks)]:
        assert rows[0][0] == "short" and rows[0][1] == 1
    assert run.requests["long"].output_token_ids == reference(prompt(2, 100), 2)


def test_without_chunked_prefill_a_prompt_runs_whole():
    with pytest.raises(ConfigError):
        make(max_num_batched_tokens=16, max_model_len=17, chunked=False)
    run = make(max_num_batched_tokens=16, max_model_len=16, chunked=False)
    run.add(Request("a", prompt(1, 12)), max_tokens=3)
    run.add(Request("b", prompt(2, 10)), max_tokens=3)
    run.run()
    assert run.steps[0] == [("a", 12, False)]  # b's 10 tokens do not fit the 4 left, nor split
    assert run.steps[1] == [("a", 1, True), ("b", 10, False)]


def test_preemption_under_page_pressure_recomputes_to_the_same_outputs():
    run = make(num_pages=13, page_size=2, max_num_seqs=4, max_num_batched_tokens=16)  # 12 pages
    for i in range(4):
        run.add(Request(f"r{i}", prompt(10 + i, 5)), max_tokens=8)  # 12 tokens = 6 pages each
    run.run()
    assert run.sched.stats().num_preemptions > 0
    for r in run.requests.values():
        assert r.output_token_ids == reference(r.prompt_token_ids, 8)


def test_abort_in_every_state_frees_everything():
    run = make(num_pages=13, page_size=2, max_num_seqs=4, max_num_batched_tokens=16)
    for i in range(5):
        run.add(Request(f"r{i}", prompt(10 + i, 5)), max_tokens=8)
    seen = set()
    while run.step():
        for r in list(run.sched.running) + list(run.sched.waiting):
            if r.status not in seen:
                seen.add(r.status)
                assert run.sched.abort(r.request_id)
                run.end(r)
                assert r.page_table == [] and r.status == RequestStatus.FINISHED_ABORTED
                run.sched.cache.check_invariants()
    assert seen == {RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED}
    run.check_drained()


def test_the_victim_is_the_most_recent_admission_or_the_lowest_priority():
    for priorities, victim in (((0, 0), "b"), ((1, 0), "a")):
        run = make(num_pages=7, page_size=2, max_num_seqs=2, max_num_batched_tokens=8)  # 6 pages
        run.add(Request("a", prompt(1, 5), priority=priorities[0]), max_tokens=6)
        run.add(Request("b", prompt(2, 5), priority=priorities[1]), max_tokens=6)
        run.run()
        assert run.preemptions and run.preemptions[0] == victim, priorities
        for r in run.requests.values():
            assert r.output_token_ids == reference(r.prompt_token_ids, 6)


def test_priority_then_arrival_order():
    run = make(max_num_seqs=1, max_num_batched_tokens=32)
    for rid, prio in (("p2", 2), ("a0", 0), ("p1", 1), ("b0", 0)):
        run.add(Request(rid, prompt(len(rid) + prio, 4), priority=prio), max_tokens=2)
    run.run()
    order = [rows[0][0] for rows in run.steps if not rows[0][2]]  # each request's prefill step
    assert order == ["a0", "b0", "p1", "p2"]


def test_a_more_important_arrival_preempts_a_running_request():
    def last_step(run: Run, rid: str) -> int:
        return max(i for i, rows in enumerate(run.steps) if any(r == rid for r, _, _ in rows))

    # No free sequence slot, then no free page: the least important running request makes room.
    for max_num_seqs, num_pages, victim in ((1, 64, "low"), (4, 10, "low2")):
        run = make(max_num_seqs=max_num_seqs, num_pages=num_pages, page_size=4,
                   max_num_batched_tokens=16)
        run.add(Request("low", prompt(1, 20), priority=1), max_tokens=10)
        run.add(Request("low2", prompt(2, 8), priority=1), max_tokens=10)
        for _ in range(3):
            run.step()
        assert not run.preemptions
        run.add(Request("high", prompt(3, 6), priority=0), max_tokens=3)
        run.run()
        assert run.preemptions[0] == victim
        assert last_step(run, "high") < min(last_step(run, "low"), last_step(run, "low2"))
        for r in run.requests.values():
            assert r.output_token_ids == reference(r.prompt_token_ids, run.max_tokens[r.request_id])


def test_resubmitted_prompt_hits_the_prefix_cache_with_the_same_outputs():
    run = make(page_size=4)
    p = prompt(7, 22)
    run.add(Request("first", p), max_tokens=4)
    run.run()
    assert run.sched.stats().prefix_cache_hits == 0
    assert run.sched.stats().pages_cached_free == 22 // 4 + 1  # 5 prompt pages + 1 of outputs
    run.add(Request("again", list(p)), max_tokens=4)
    run.run()
    again = run.requests["again"]
    assert again.num_cached_prompt_tokens == 20  # 5 full pages; the 21st token onward computed
    assert run.steps[-4][0] == ("again", 2, False)
    assert run.sched.stats().prefix_cache_hits == 20
    assert again.output_token_ids == run.requests["first"].output_token_ids == reference(p, 4)


def test_identical_prompts_in_one_batch_compute_their_shared_pages_once():
    for prefix in (True, False):
        run = make(page_size=4, max_num_batched_tokens=32, prefix=prefix)
        p = prompt(5, 40)
        for i in range(4):  # as the engine submits n=4 samples of one prompt
            run.add(Request(f"s{i}", list(p)), max_tokens=3)
        run.run()
        computed = sum(n for rows in run.steps for rid, n, was_decode in rows if not was_decode)
        cached = [run.requests[f"s{i}"].num_cached_prompt_tokens for i in range(4)]
        if prefix:
            assert cached == [0, 36, 36, 36] and computed == 40 + 3 * 4
        else:
            assert cached == [0, 0, 0, 0] and computed == 4 * 40
        for r in run.requests.values():
            assert r.output_token_ids == reference(p, 3)


def test_a_prompt_that_can_never_fit_the_pool_ends_in_error_not_livelock():
    run = make(num_pages=5, page_size=2)  # 4 pages = 8 tokens
    run.add(Request("huge", prompt(1, 9)), max_tokens=1)
    run.add(Request("grows", prompt(2, 6)), max_tokens=5)  # needs 10 tokens of KV at the end
    run.add(Request("fine", prompt(3, 3)), max_tokens=2)
    run.run()
    assert run.ends == {"huge": [RequestStatus.FINISHED_ERROR],
                        "grows": [RequestStatus.FINISHED_ERROR],
                        "fine": [RequestStatus.FINISHED_LENGTH]}
    assert run.requests["fine"].output_token_ids == reference(prompt(3, 3), 2)


def test_a_request_outgrowing_max_model_len_ends_with_length():
    run = make(max_model_len=8, page_size=4)
    run.add(Request("a", prompt(1, 6)), max_tokens=10)
    run.run()
    assert run.ends["a"] == [RequestStatus.FINISHED_LENGTH]
    assert run.requests["a"].output_token_ids == reference(prompt(1, 6), 3)


def test_add_request_invariants():
    """The engine checks requests once (test_engine); here they are assertions."""
    run = make(max_model_len=8)
    run.add(Request("a", [1, 2]), 1)
    with pytest.raises(AssertionError):
        run.sched.add_request(Request("a", [3]))
    with pytest.raises(AssertionError):
        run.sched.add_request(Request("empty", []))
    with pytest.raises(AssertionError):
        run.sched.add_request(Request("long", list(range(9))))
    assert run.sched.stats().num_waiting == 1


def test_add_requests_is_all_or_nothing_and_keeps_arrival_order():
    run = make(max_num_seqs=1)
    run.sched.add_requests([Request("a", [1]), Request("b", [2])])
    for bad in ([Request("c", [1]), Request("c", [2])], [Request("d", [1]), Request("a", [2])],
                [Request("e", [1]), Request("f", [])]):
        with pytest.raises(AssertionError):
            run.sched.add_requests(bad)
    assert run.sched.stats().num_waiting == 2
    run.sched.add_requests([Request(f"n{i}", [3]) for i in range(3)])
    assert [r.request_id for r in run.sched.waiting] == ["a", "b", "n0", "n1", "n2"]  # FIFO


def _python_lines(fn) -> int:
    """How many Python lines run while fn() does (jaxserve's and its libraries'): an operation
    count, not a time."""
    count = 0

    def trace(frame, event, arg):
        nonlocal count
        count += event == "line"
        return trace

    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


def test_admitting_n_sequences_costs_the_same_behind_a_long_queue():
    """Issue 12: n = 1,000,000 once froze the engine in n sorted inserts of O(W) each. Queuing
    128 sequences behind 20,000 waiting runs no more Python than behind 100 (the old insert
    rebuilt a W-long key list for every sequence)."""
    def lines_to_add(waiting: int) -> int:
        sched = make(num_pages=8, max_num_seqs=1).sched
        for start in range(0, waiting, 1000):
            sched.add_requests([Request(f"w{i}", [1, 2]) for i in range(start,
                                                                    min(waiting, start + 1000))])
        new = [Request(f"seq{i}", [3, 4]) for i in range(128)]
        lines = _python_lines(lambda: sched.add_requests(new))
        assert sched.stats().num_waiting == waiting + 128
        return lines

    short, long = lines_to_add(100), lines_to_add(20_000)
    assert long <= 1.2 * short, (short, long)


def test_abort_between_schedule_and_update_skips_the_row_and_frees_pages():
    run = make()
    run.add(Request("a", prompt(1, 10)), max_tokens=3)
    run.add(Request("b", prompt(2, 10)), max_tokens=3)
    run.before_update = lambda r: r.finish("a", RequestStatus.FINISHED_ABORTED) and None
    run.step()
    run.before_update = None
    a = run.requests["a"]
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert a.page_table == [] and not a.output_token_ids
    assert run.sched.get_request("a") is None and not run.sched.abort("a")
    run.run()
    assert run.requests["b"].output_token_ids == reference(prompt(2, 10), 3)


def test_stats_separate_live_pages_from_cached_ones():
    run = make(num_pages=33, page_size=4)
    run.add(Request("a", prompt(1, 9)), max_tokens=3)
    run.step()
    s = run.sched.stats()
    assert (s.num_running, s.num_waiting, s.pages_in_use, s.num_usable_pages) == (1, 0, 3, 32)
    run.run()
    s = run.sched.stats()
    assert (s.num_running, s.pages_in_use, s.pages_cached_free) == (0, 0, 2)
    assert s.prefix_cache_queries == 9


@given(prompt_len=st.integers(1, 6), num_out=st.integers(0, 6), data=st.data())
def test_token_slice_equals_slicing_all_token_ids(prompt_len, num_out, data):
    r = Request("a", list(range(prompt_len)), output_token_ids=list(range(100, 100 + num_out)))
    start = data.draw(st.integers(0, r.num_tokens))
    stop = data.draw(st.integers(start, r.num_tokens))
    assert r.token_slice(start, stop) == r.all_token_ids[start:stop]


# ---- tenants, classes, deadlines ---------------------------------------------------------------


def first_steps(run: Run) -> list[str]:
    """Request ids in the order they were first scheduled."""
    seen = []
    for rows in run.steps:
        seen += [rid for rid, _, _ in rows if rid not in seen]
    return seen


def test_deadline_ends_a_request_queued_or_running_and_frees_its_pages_at_once():
    run = make(max_num_seqs=1)
    run.add(Request("running", prompt(1, 8), deadline=3.0), max_tokens=20)
    run.add(Request("queued", prompt(2, 8), deadline=2.0), max_tokens=20)
    run.add(Request("fine", prompt(3, 8)), max_tokens=3)
    for _ in range(3):  # t = 0, 1, 2: prefill + 2 decodes; "queued" expires at t = 2
        run.step()
    assert run.ends == {"queued": [RequestStatus.FINISHED_DEADLINE]}
    assert run.sched.cache.num_pages_in_use == 3  # "running": 10 tokens in 4-token pages
    run.step()  # t = 3: "running" expires before anything is scheduled; "fine" starts
    assert run.ends["running"] == [RequestStatus.FINISHED_DEADLINE]
    assert run.steps[-1] == [("fine", 8, False)]
    assert run.requests["running"].output_token_ids == reference(prompt(1, 8), 3)
    assert not run.requests["queued"].output_token_ids
    run.run()
    assert run.ends["fine"] == [RequestStatus.FINISHED_LENGTH]


def test_queue_timeout_ends_only_requests_that_never_started():
    run = make(max_num_seqs=1)
    run.add(Request("low", prompt(1, 8), queue_deadline=1.5), max_tokens=6)
    run.step()  # t = 0: "low" starts
    run.add(Request("high", prompt(2, 8), priority=-1), max_tokens=3)
    run.add(Request("queued", prompt(3, 8), queue_deadline=2.0), max_tokens=3)
    run.run()  # t = 1: "high" preempts "low" for the seat; t = 2: "queued" times out
    assert run.preemptions == ["low"]
    assert run.ends["queued"] == [RequestStatus.FINISHED_QUEUE_TIMEOUT]
    assert "queued" not in first_steps(run)
    assert run.ends["low"] == run.ends["high"] == [RequestStatus.FINISHED_LENGTH]
    assert run.requests["low"].output_token_ids == reference(prompt(1, 8), 6)


def test_kv_page_budget_makes_only_the_tenants_own_requests_wait():
    run = make(num_pages=33, page_size=4, max_num_batched_tokens=64)  # 32 pages
    # a's budget: 8 pages. Each request: 20 prompt tokens (5 pages) + 4 outputs (6 pages).
    for rid, tenant in (("a1", "a"), ("a2", "a"), ("b1", "b"), ("b2", "b")):
        run.add(Request(rid, prompt(len(run.requests), 20), tenant=tenant,
                        kv_page_fraction=0.25 if tenant == "a" else None), max_tokens=4)
    run.run()
    assert [rid for rid, _, _ in run.steps[0]] == ["a1", "b1", "b2"]  # a2: 5 + 5 > 8 pages
    a1_last = max(i for i, rows in enumerate(run.steps) if any(r == "a1" for r, _, _ in rows))
    a2_first = min(i for i, rows in enumerate(run.steps) if any(r == "a2" for r, _, _ in rows))
    assert a2_first == a1_last + 1
    for r in run.requests.values():
        assert r.output_token_ids == reference(r.prompt_token_ids, 4)


def test_a_flooding_tenant_does_not_delay_another_tenants_next_start():
    for flood in (10, 200):
        run = make(max_num_seqs=2, num_pages=257)
        for i in range(flood):
            run.add(Request(f"a{i}", prompt(i, 6), tenant="a"), max_tokens=4)
        for _ in range(3):
            run.step()
        started = len(first_steps(run))
        run.add(Request("b", prompt(999, 6), tenant="b"), max_tokens=4)
        run.run(max_steps=5000)
        assert first_steps(run)[started] == "b", flood  # the next seat that frees is b's


def test_backlogged_tenants_share_the_computed_tokens_by_weight():
    run = make(num_pages=257, page_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    weights = {"a": 1, "b": 2, "c": 4}
    for i in range(60):
        for k, (t, w) in enumerate(weights.items()):
            run.add(Request(f"{t}{i}", prompt(1000 * k + i, 8), tenant=t, weight=w,
                            max_tokens=8), max_tokens=8)
    served = dict.fromkeys(weights, 0)
    while all(any(r.tenant == t for r in run.sched.waiting) for t in weights):
        run.step()
        for rid, n, _ in run.steps[-1]:
            served[run.requests[rid].tenant] += n
    total = sum(served.values())
    assert total > 1000
    for t, w in weights.items():
        assert abs(served[t] / total - w / sum(weights.values())) < 0.04, served


def test_shed_victims_come_from_less_important_classes_and_never_started():
    run = make(max_num_seqs=1)
    run.add(Request("batch-old", prompt(1, 6), priority=1), max_tokens=3)
    run.step()  # it runs: never a shed victim
    for rid, prio in (("batch-new", 1), ("std", 0), ("batch-newest", 1)):
        run.add(Request(rid, prompt(len(rid), 6), priority=prio), max_tokens=3)
    assert [r.request_id for r in run.sched.shed_order(-1)] == ["batch-newest", "batch-new",
                                                                "std"]
    assert [r.request_id for r in run.sched.shed_order(0)] == ["batch-newest", "batch-new"]
    victim = next(run.sched.shed_order(0))
    assert run.finish(victim.request_id, RequestStatus.FINISHED_SHED)
    run.run()
    assert run.ends["batch-newest"] == [RequestStatus.FINISHED_SHED]


# ---- properties over random workloads ---------------------------------------------------------

STEMS = [prompt(100 + i, 24) for i in range(3)]


@st.composite
def workloads(draw):
    page_size = draw(st.sampled_from([1, 2, 4, 8]))
    # Pools of 12-64 tokens against prompts of up to 36 and outputs of up to 12: page pressure
    # (preemption) is common and a few requests can never fit (errors).
    num_pages = 1 + max(1, draw(st.integers(12, 64)) // page_size)
    max_num_seqs = draw(st.integers(1, 6))
    budget = draw(st.integers(max_num_seqs, 40))
    requests = draw(st.lists(st.fixed_dictionaries({
        "stem": st.integers(0, len(STEMS) - 1),
        "shared": st.integers(1, 24),  # leading tokens taken from the stem: prompts share prefixes
        "tail": st.lists(st.integers(0, VOCAB - 1), max_size=12),
        "max_tokens": st.integers(1, 12),
        "priority": st.integers(0, 2),
        "arrives": st.integers(0, 8),  # step at which the request is added
        "tenant": st.integers(0, 2),
        "deadline": st.none() | st.integers(1, 30),  # steps after arrival
        "queue_deadline": st.none() | st.integers(1, 10),
    }), min_size=1, max_size=10))
    aborts = draw(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 3), st.booleans()),
                           max_size=3))
    sheds = draw(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 1), st.integers(1, 3)),
                          max_size=2))  # (step, shed below this priority, how many)
    # per tenant: (weight, kv_page_fraction)
    tenants = draw(st.lists(st.tuples(st.integers(1, 4), st.none() | st.sampled_from([0.3, 0.6])),
                            min_size=3, max_size=3))
    return dict(page_size=page_size, num_pages=num_pages, max_num_seqs=max_num_seqs, budget=budget,
                prefix=draw(st.booleans()), chunked=draw(st.booleans()), requests=requests,
                aborts=aborts, sheds=sheds, tenants=tenants,
                speculative_tokens=draw(st.sampled_from([0, 0, 1, 3])))


_TIMED_OUT = (RequestStatus.FINISHED_DEADLINE, RequestStatus.FINISHED_QUEUE_TIMEOUT)


@settings(max_examples=400, deadline=None)
@given(w=workloads())
def test_random_workloads(w):
    """Every request ends exactly once; no page leaks (invariants after every step, all pages free
    at the end); budget, max_num_seqs and decode-first order hold each step (checked in Run.step);
    outputs equal the reference whatever the batching, chunking, prefix sharing, preemption,
    tenants' shares, KV budgets and speculative drafts (right or wrong); a request errors iff its KV can never fit the pool; aborts,
    sheds and deadlines at any moment free everything; nothing expired is ever scheduled (Run.step);
    a queue timeout or a shed ends a request that never started, with nothing generated."""
    run = make(num_pages=w["num_pages"], page_size=w["page_size"], max_num_seqs=w["max_num_seqs"],
               max_num_batched_tokens=w["budget"] if w["chunked"] else 64, max_model_len=64,
               prefix=w["prefix"], chunked=w["chunked"],
               speculative_tokens=w["speculative_tokens"])
    pending = sorted(enumerate(w["requests"]), key=lambda x: x[1]["arrives"])
    aborted, shed = set(), set()

    def shed_some(step: int):
        for at, below, count in w["sheds"]:
            if at == step:
                for r in list(itertools.islice(run.sched.shed_order(below), count)):
                    assert r.priority > below and r.status == RequestStatus.WAITING
                    assert run.finish(r.request_id, RequestStatus.FINISHED_SHED)
                    shed.add(r.request_id)

    def abort(step: int, mid: bool):
        for at, idx, when in w["aborts"]:
            rid = f"r{idx}"
            if at == step and when == mid and rid in run.requests and run.finish(
                    rid, RequestStatus.FINISHED_ABORTED):
                aborted.add(rid)

    step = 0
    while pending or run.sched.has_unfinished():
        assert step < 3000, "no progress"
        while pending and pending[0][1]["arrives"] <= step:
            i, d = pending.pop(0)
            weight, kv_fraction = w["tenants"][d["tenant"]]
            run.add(Request(f"r{i}", STEMS[d["stem"]][:d["shared"]] + d["tail"],
                            priority=d["priority"], tenant=f"t{d['tenant']}", weight=weight,
                            kv_page_fraction=kv_fraction, max_tokens=d["max_tokens"],
                            deadline=None if d["deadline"] is None else step + d["deadline"],
                            queue_deadline=None if d["queue_deadline"] is None
                            else step + d["queue_deadline"]), d["max_tokens"])
        abort(step, False)
        shed_some(step)
        run.before_update = lambda _, s=step: abort(s, True)
        if not run.step() and pending:
            pending[0][1]["arrives"] = step + 1  # idle: jump to the next arrival
        step += 1
    run.check_drained()
    stats = run.sched.stats()
    event("preempted", stats.num_preemptions > 0)
    event("prefix hits", stats.prefix_cache_hits > 0)
    event("aborted", bool(aborted))
    event("shed", bool(shed))
    event("errored", any(v == [RequestStatus.FINISHED_ERROR] for v in run.ends.values()))
    event("timed out", any(v[0] in _TIMED_OUT for v in run.ends.values()))
    event("drafts stood", stats.num_accepted_draft_tokens > 0)
    usable = w["num_pages"] - 1
    for rid, r in run.requests.items():
        m = run.max_tokens[rid]
        assert r.output_token_ids == reference(r.prompt_token_ids, m)[:len(r.output_token_ids)]
        if rid in aborted:
            assert run.ends[rid] == [RequestStatus.FINISHED_ABORTED]
            continue
        if rid in shed or run.ends[rid] == [RequestStatus.FINISHED_QUEUE_TIMEOUT]:
            assert not r.output_token_ids and r.num_cached_prompt_tokens == 0, rid
            continue
        if run.ends[rid] == [RequestStatus.FINISHED_DEADLINE]:
            assert r.deadline is not None
            continue
        m = run.max_tokens[rid]
        if pages_for(r.num_prompt_tokens + m - 1, w["page_size"]) > usable:
            assert run.ends[rid] == [RequestStatus.FINISHED_ERROR], rid
        else:
            assert run.ends[rid] == [RequestStatus.FINISHED_LENGTH], rid
            assert r.output_token_ids == reference(r.prompt_token_ids, m), rid
