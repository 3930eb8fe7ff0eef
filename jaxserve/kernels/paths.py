"""Which path each kernel family takes in this process: the line an engine logs when it is built
and `jaxserve kernels status` prints.

    kernels: attention=cpu sampler=cpu matmul=cpu
    kernels: attention=xla sampler=xla matmul=xla; CPU kernels off: JAXSERVE_CPU_KERNELS=off
    kernels: attention=cpu sampler=cpu matmul=xla; matmul on XLA: tensor parallel

attention: `cpu` (decodes and verifies through the C++ kernel, prefill on the tuned XLA path),
`xla` (the tuned XLA path alone), `pallas_gpu` or `pallas_tpu`. sampler: `cpu` (the C++ top-k /
top-p thresholds) or `xla` (bisection). matmul: `cpu` (the layers' projections read in place by
the C++ kernel, in steps of its row range) or `xla`.
"""

from __future__ import annotations

from jaxserve.kernels import attention
from jaxserve.kernels import cpu


def summary(matmul_off: str | None = None) -> str:
    """The line for this process; `matmul_off`: why the model keeps its projections on XLA
    whatever the switch (decoder.why_matmul_off), if it does. Builds the CPU kernels' library if
    they are switched on and it is not built yet."""
    why = cpu.why_off()
    on = "cpu" if why is None else "xla"
    matmul = "cpu" if why is None and matmul_off is None else "xla"
    line = f"kernels: attention={attention.auto_impl()} sampler={on} matmul={matmul}"
    if why is not None:
        return f"{line}; CPU kernels off: {why}"
    if matmul_off is not None:
        return f"{line}; matmul on XLA: {matmul_off}"
    return line
