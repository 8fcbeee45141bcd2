"""The wandb mirror, under the name the integrations list: ``dynascope.integrations.wandb.WandbMirror``.

The mirror is a listener of the probes (``dynascope.probes.wandb_mirror``), so that ``watch(wandb=True)``
builds it without the probes importing an integration; this module keeps the integrations' import path.
"""

from __future__ import annotations

from dynascope.probes.wandb_mirror import PREFIX, STEP_KEY, WandbMirror

__all__ = ["PREFIX", "STEP_KEY", "WandbMirror"]
