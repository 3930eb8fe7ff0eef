"""Shared fixtures: golden outputs and the real SmolLM2 model, loaded once per session."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

GOLDEN_DIR = Path(__file__).resolve().parents[2] / "shared" / "golden"
SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    return GOLDEN_DIR


@pytest.fixture(scope="session")
def smollm2_golden() -> dict:
    return json.loads((GOLDEN_DIR / "smollm2_golden.json").read_text())


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The GGUF, fetched and verified by the same code path `make serve` uses."""
    from jaxserve.model_registry import fetch

    return fetch(SMOLLM2, quiet=True)


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """(config, params) of SmolLM2 in float32 on the default device."""
    from jaxserve.model_registry import resolve
    from jaxserve.weights import load_model

    return load_model(resolve(SMOLLM2), dtype="float32")


@pytest.fixture
def attention_kernel(monkeypatch):
    """Until the kernels engineer's reference lands: a dense helper with the kernel's contract."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import ragged_paged_attention as rpa

    if hasattr(rpa, "ragged_paged_attention"):
        return

    def write_kv(kv_cache, k, v, slot_mapping):
        P, ps, H2, D = kv_cache.shape
        kv = jnp.stack([k, v], axis=2).reshape(k.shape[0], H2, D)
        flat = kv_cache.reshape(P * ps, H2, D).at[slot_mapping].set(kv.astype(kv_cache.dtype))
        return flat.reshape(P, ps, H2, D)

    def ragged_paged_attention(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                               sliding_window=None, soft_cap=None):
        T, Hq, D = q.shape
        _, ps, H2, _ = kv_cache.shape
        rows = jnp.arange(T)
        seq = jnp.clip(jnp.searchsorted(cu_q_lens, rows, side="right") - 1, 0, kv_lens.shape[0] - 1)
        live = rows < cu_q_lens[num_seqs[0]]
        q_pos = kv_lens[seq] - (cu_q_lens[seq + 1] - cu_q_lens[seq]) + (rows - cu_q_lens[seq])
        kv = kv_cache[page_indices[seq]].reshape(T, -1, H2, D)  # [T, pages*ps, 2Hkv, D]
        k, v = kv[:, :, 0::2], kv[:, :, 1::2]
        group = Hq // k.shape[2]
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        s = jnp.einsum("thd,tkhd->thk", q.astype(jnp.float32), k.astype(jnp.float32),
                       precision="highest") * sm_scale
        kpos = jnp.arange(k.shape[1])
        mask = kpos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            mask &= kpos[None, :] > q_pos[:, None] - sliding_window
        s = jnp.where(mask[:, None, :], s, -1e30)
        out = jnp.einsum("thk,tkhd->thd", jax.nn.softmax(s, axis=-1), v.astype(jnp.float32),
                         precision="highest")
        return jnp.where(live[:, None, None], out, 0).astype(q.dtype)

    monkeypatch.setattr(rpa, "write_kv", write_kv, raising=False)
    monkeypatch.setattr(rpa, "ragged_paged_attention", ragged_paged_attention, raising=False)
