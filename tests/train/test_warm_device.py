"""A restarted peer's warm-up (``noloco.train.device.warm_device``) on the CPU: the compiler stack's import only."""

from __future__ import annotations

import subprocess
import sys


def test_warm_device_on_the_cpu_imports_the_compiler_stack_and_touches_no_cuda():
    """In a fresh process: ``torch._dynamo`` (which the first AdamW imports) is imported once the returned thread
    has ended, CUDA is left alone, and an AdamW then builds and steps."""
    script = (
        "import sys, torch; from noloco.train.device import warm_device\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "thread = warm_device('cpu'); thread.join()\n"
        "assert not thread.is_alive() and 'torch._dynamo' in sys.modules and not torch.cuda.is_initialized()\n"
        "p = torch.nn.Parameter(torch.ones(3)); opt = torch.optim.AdamW([p], lr=0.1)\n"
        "p.grad = torch.ones(3); opt.step(); print(round(float(p.sum()), 4))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2.697", out.stdout
