"""Alert rules: a quantity the store has, a condition, how many steps it must hold, and what to do.

    Rule("loss", "> 100", action="stop")
    Rule("straggler_score", "< 0.75", window=5, action=["warn", "webhook"], url="http://127.0.0.1:9000/hook")
    Rule("grad_norm_spike")                       # a detector: fires on each event it reports

A rule fires for one series (a run, role and rank) at the step where its condition has held on the last
``window`` recorded steps; it then stays quiet on that series for ``hold_down`` steps, so one spike gives
one alert. The quantities are listed in ``dynascope.alerts.quantities``; the defaults are ``DEFAULT_RULES``.
"""

from __future__ import annotations

import math
import operator
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ACTIONS", "DEFAULT_RULES", "Rule", "load_rules", "rules_from"]

ACTIONS = ("event", "warn", "webhook", "stop")
SEVERITIES = ("info", "warning", "error", "critical")
_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge, "<=": operator.le, "==": operator.eq, "!=": operator.ne, ">": operator.gt, "<": operator.lt}
_CONDITION = re.compile(r"^\s*(>=|<=|==|!=|>|<)\s*([-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|nan|inf)\s*$")


@dataclass(frozen=True)
class Rule:
    """One alert rule; ``condition`` is ``"<op> <number>"`` (op one of > >= < <= == !=), or ``"fires"``
    for a detector, whose events are the firings. ``action`` is one action or a list of them; ``event``
    is always done."""

    quantity: str
    condition: str = "fires"
    window: int = 1
    action: str | Sequence[str] = "warn"
    severity: str = "warning"
    hold_down: int = 20
    name: str | None = None
    url: str | None = None
    message: str | None = None
    actions: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        acts = (self.action,) if isinstance(self.action, str) else tuple(self.action)
        bad = [a for a in acts if a not in ACTIONS]
        if bad:
            raise ValueError(f"rule {self.label}: unknown action {bad[0]!r} (one of {', '.join(ACTIONS)})")
        if "webhook" in acts and not self.url:
            raise ValueError(f"rule {self.label}: the webhook action needs url=")
        if self.severity not in SEVERITIES:
            raise ValueError(f"rule {self.label}: severity must be one of {', '.join(SEVERITIES)}")
        if self.window < 1 or self.hold_down < 0:
            raise ValueError(f"rule {self.label}: window must be >= 1 and hold_down >= 0")
        if self.condition != "fires" and not _CONDITION.match(self.condition):
            raise ValueError(f"rule {self.label}: condition {self.condition!r} is not '<op> <number>' or 'fires'")
        object.__setattr__(self, "actions", tuple(dict.fromkeys(("event", *acts))))

    @property
    def label(self) -> str:
        return self.name or f"{self.quantity} {self.condition}".strip()

    @property
    def threshold(self) -> float | None:
        m = _CONDITION.match(self.condition)
        return float(m.group(2)) if m else None

    def holds(self, value: float | None) -> bool:
        """Whether ``value`` meets the condition (a detector's events always do; NULL never does)."""
        if self.condition == "fires":
            return True
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return False
        m = _CONDITION.match(self.condition)
        assert m is not None
        return _OPS[m.group(1)](float(value), float(m.group(2)))


# The defaults for RL post-training, documented in docs/alerts.md (one place; the Prometheus rules in
# deploy/prometheus/dynascope-rules.yml say the same in PromQL).
DEFAULT_RULES: tuple[Rule, ...] = (
    Rule("grad_norm_spike", name="gradient-norm spike"),
    Rule("nan_inf", severity="error", name="NaN/Inf in gradients, weights or scalars"),
    Rule("entropy_collapse", name="entropy collapse"),
    Rule("frac_reward_zero_std", "> 0.8", window=5, name="most groups have zero reward variance"),
    Rule("straggler_score", "< 0.75", window=5, name="straggler rank"),
    Rule("rollout_tail_x", "> 4", window=3, name="rollout tail: p99 over 4x the median generation"),
    Rule("weight_sync_ms", "> 30000", window=1, name="weight sync over 30 s"),
    Rule("logprob_gap_over_pct", "> 5", window=3, name="trainer-rollout log-prob gap tail"),
    Rule("probe_pct", "> 3", window=10, name="probe over its 3% budget"),
)


def _from_dict(d: dict[str, Any], where: str) -> Rule:
    if not isinstance(d, dict) or "quantity" not in d:
        raise ValueError(f"{where}: each rule is a mapping with at least 'quantity'")
    known = {"quantity", "condition", "window", "action", "severity", "hold_down", "name", "url", "message"}
    extra = sorted(set(d) - known)
    if extra:
        raise ValueError(f"{where}: unknown key {extra[0]!r} (known: {', '.join(sorted(known))})")
    return Rule(**d)


def load_rules(path: str | os.PathLike) -> list[Rule]:
    """Rules from a YAML file: a list of mappings, or ``{rules: [...], defaults: true}`` to add the defaults."""
    import yaml

    p = Path(path).expanduser()
    try:
        doc = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise ValueError(f"{p}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{p}: not YAML ({str(exc).splitlines()[0]})") from None
    defaults = False
    if isinstance(doc, dict):
        defaults = bool(doc.get("defaults", False))
        doc = doc.get("rules", [])
    if not isinstance(doc, list):
        raise ValueError(f"{p}: expected a list of rules")
    rules = [_from_dict(d, f"{p}: rule {i + 1}") for i, d in enumerate(doc)]
    return [*DEFAULT_RULES, *rules] if defaults else rules


def rules_from(spec: Any) -> list[Rule]:
    """``True`` → the defaults; a path (str/Path) → ``load_rules``; a list of ``Rule`` or dicts → those."""
    if spec is True:
        return list(DEFAULT_RULES)
    if not spec:
        return []
    if isinstance(spec, (str, os.PathLike)):
        return load_rules(spec)
    if isinstance(spec, Rule):
        return [spec]
    return [r if isinstance(r, Rule) else _from_dict(r, f"rule {i + 1}") for i, r in enumerate(spec)]
