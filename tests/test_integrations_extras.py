"""Without the optional extras dynascope still imports, and each integration names the extra it needs."""

from __future__ import annotations

import subprocess
import sys

import pytest

# (module blocked, code that uses the integration, extra the error must name)
CASES = [
    ("transformers", "from dynascope.integrations.hf import DynascopeCallback", "hf"),
    ("lightning", "import dynascope.integrations.lightning", "lightning"),
    ("wandb", "from dynascope.integrations.wandb import WandbMirror; WandbMirror()", "wandb"),
    ("ray", "from dynascope.integrations.ray import actor_scope; actor_scope('r', role='x')", "ray"),
    ("deepspeed", "import dynascope.integrations.deepspeed", "deepspeed"),
]


def _run(blocked: list[str], code: str) -> subprocess.CompletedProcess:
    # a None entry in sys.modules makes `import x` raise ImportError, as if x were not installed
    prelude = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in blocked)
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("module", "code", "extra"), CASES)
def test_missing_extra_names_the_extra(module, code, extra):
    blocked = [module, "pytorch_lightning"] if module == "lightning" else [module]
    result = _run(blocked, code)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert "MissingExtraError" in last and f"pip install -e '.[{extra}]'" in last, result.stderr[-2000:]


def test_core_imports_without_any_extra(tmp_path):
    code = (f"import dynascope, torch\n"
            f"s = dynascope.watch(torch.nn.Linear(2, 2), run={str(tmp_path / 'r')!r}, system_interval_s=None)\n"
            f"s.close()\n"
            f"import dynascope.integrations, dynascope.integrations.verl\n"
            f"assert not any(m in sys.modules and sys.modules[m] for m in ('transformers', 'wandb', 'ray'))\n"
            f"print('ok')")
    result = _run(["transformers", "trl", "lightning", "pytorch_lightning", "wandb", "ray", "deepspeed"], code)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
