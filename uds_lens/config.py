"""The settings of an audit, on the ground floor: every default and every check written once.

``UDSConfig`` is what a user sets (the CLI's ``score``, ``sweep`` and ``diagnose`` options are derived from it);
``EngineSpec`` is the part of it a patching engine needs, handed over as one typed value instead of loose arguments.
The vocabularies (sites, scopes, engines, dtype names) are ``Literal`` types, so a type checker catches a misspelt
site and the run-time check reads the same list. This module imports no torch at module level: ``uds.py`` (pure
NumPy) takes its default threshold from here.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any, Literal, get_args, no_type_check

Site = Literal["resid_post", "resid_mid", "attn_out", "mlp_out", "resid_pre"]
"""Hook site patched in every block: ``blocks.<l>.hook_<site>``."""
Scope = Literal["span", "boundary"]
"""Which positions are patched: those that predict the entity tokens, or only the last prompt token."""
Engine = Literal["fast", "naive"]
"""How patched runs are computed: from the clean run's KV cache (fast) or one full forward per layer (the oracle)."""
DtypeName = Literal["float32", "fp32", "bfloat16", "bf16", "float16", "fp16"]
"""Spellings of the three floating dtypes a checkpoint can be loaded in."""
Stage2Cells = Literal["all", "ke"]
"""Which (example, layer) cells Stage 2 patches: every one (the layer curves), or only the KE cells (``d1 > tau``),
the only ones UDS reads."""

SITES: tuple[Site, ...] = get_args(Site)
SCOPES: tuple[Scope, ...] = get_args(Scope)
ENGINES: tuple[Engine, ...] = get_args(Engine)
DTYPE_NAMES: tuple[DtypeName, ...] = get_args(DtypeName)
STAGE2_CELLS: tuple[Stage2Cells, ...] = get_args(Stage2Cells)

DEFAULT_TAU = 0.05
"""KE threshold on ``d1`` in nats (strict ``>``), the paper's value; also the logit lens's."""

DEFAULT_PRECISION_TOLERANCE = 1e-3
"""How far rounding may move a per-example UDS of a bf16/fp16 run from the fp32 run's (``precision_tolerance``)."""


class ConfigError(ValueError):
    """An audit setting is out of range; the message names the option and what it accepts."""


def finite_real(value: Any) -> bool:
    """Whether ``value`` is a real number (not a bool) a float can hold: ``10**400`` is not (``math.isfinite``
    raises ``OverflowError`` on it)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def shown(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (a 400-digit integer in a message is one line, not a page)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_tau(tau: Any) -> float:
    """``tau`` as a float, or [`ConfigError`][uds_lens.config.ConfigError] naming ``--tau`` (every entry point checks it here)."""
    if not finite_real(tau) or tau < 0:
        raise ConfigError(
            f"tau (--tau) must be a finite number of nats >= 0, got {shown(tau)}; the paper uses "
            f"{DEFAULT_TAU} (a negative threshold makes layers where retain is *more* confident KE)."
        )
    return float(tau)


def check_choice(option: str, value: Any, allowed: tuple[str, ...]) -> None:
    """[`ConfigError`][uds_lens.config.ConfigError] unless ``value`` is one of ``allowed``; ``option`` names the setting and its flag."""
    if value not in allowed:
        raise ConfigError(f"{option} must be one of {', '.join(allowed)}; got {value!r}.")


def as_site(value: str) -> Site:
    """``value`` as a [`Site`][uds_lens.config.Site], or a ValueError naming the sites: for functions that take a user's string."""
    if value not in SITES:
        raise ValueError(f"Unknown patch site {value!r}; use one of {SITES}.")
    return value


def check_positive_int(option: str, value: Any, none_means: str | None) -> int | None:
    """``value`` as an int >= 1 (or None), else [`ConfigError`][uds_lens.config.ConfigError] naming ``option`` and what None means;
    ``none_means=None``: None is refused too (a count that has no default there)."""
    if value is None and none_means is not None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        alternative = f" (or None to {none_means})" if none_means is not None else ""
        raise ConfigError(f"{option} must be a positive integer{alternative}, got {value!r}.")
    return int(value)


def _is_torch_dtype(value: Any) -> bool:
    return type(value).__module__ == "torch" and type(value).__name__ == "dtype"


# ``no_type_check``: a wrong value here is user input, answered by ``__post_init__`` with a ConfigError that names
# the option and what it accepts; a run-time type checker (the test suite's jaxtyping hook) would pre-empt that
# message with a generic one. Static checkers still read the ``Literal`` fields.
@no_type_check
@dataclass(frozen=True)
class EngineSpec:
    """What a patching engine needs to know about one stage, as one value.

    Attributes:
        site: hook site patched in every block.
        layers: the layers patched, in order (one score column each).
        engine: ``fast`` or ``naive``.
        published_compat: read the source's final-norm output at the last layer and take log-softmax in the model's
            dtype, as the published implementation does.
    """

    site: Site
    layers: tuple[int, ...]
    engine: Engine = "fast"
    published_compat: bool = False

    def __post_init__(self) -> None:
        check_choice("site (--site)", self.site, SITES)
        check_choice("engine (--engine)", self.engine, ENGINES)
        object.__setattr__(self, "layers", tuple(int(layer) for layer in self.layers))

    @property
    def upcast(self) -> bool:
        """Whether log-softmax runs in float32 (everywhere except published-compat)."""
        return not self.published_compat


@no_type_check
@dataclass(frozen=True)
class UDSConfig:
    """Settings of a UDS audit (defaults from the paper).

    Attributes:
        tau: KE threshold on ``d1`` in nats (strict ``>``). Applied after the S1 cache: changing it recomputes nothing.
        patch_scope: ``span`` (patch the positions that predict the entity tokens) or ``boundary`` (only the last
            prompt token).
        site: hook site patched in every block: ``resid_post`` (default), ``resid_mid``, ``attn_out``,
            ``mlp_out`` or ``resid_pre``.
        layers: layers to patch (None = all).
        published_compat: reproduce the published implementation (trailing space kept in the prompt, the source's
            final-norm output patched at the last layer, log-softmax in the model dtype).
        batch_size: examples per batch; None chooses from a memory budget.
        dtype: of the models this auditor loads itself (default fp32 on CPU, bf16 on CUDA).
        device: where those models run (default `$UDS_LENS_DEVICE` when set, else CUDA when available, else the CPU).
        engine: ``fast`` (default) or ``naive`` (the oracle: one full forward per layer).
        stage2_cells: ``all`` (every layer's ``d2``: the layer curves), ``ke`` (only the KE cells ``d1 > tau``,
            the only ones UDS reads: the same UDS for less work; ``d2`` is NaN elsewhere and a rescore may only
            raise tau), or None: the entry point's default, ``all`` for ``score``/``UDSAuditor`` (a person looks
            at one model's curves), ``ke`` for ``sweep`` (many models, one number each). Retain-free mode has no
            KE cells and always runs ``all``.
        precision_check: in bf16/fp16 (``uds_lens.precision``), re-decide in fp32 every KE decision and ``d1`` UDS
            reads (Stage 1, once) and every clip decision inside the rounding band (Stage 2); False counts the
            fragile cells without re-deciding them. Nothing to do in fp32.
        precision_tolerance: with the check on, run Stage 2 in fp32 for the examples whose UDS the rounding band
            could move by more than this (None or ``inf``: only the fragile decisions are fp32).
    """

    tau: float = DEFAULT_TAU
    patch_scope: Scope = "span"
    site: Site = "resid_post"
    layers: tuple[int, ...] | None = None
    published_compat: bool = False
    batch_size: int | None = None
    dtype: DtypeName | None = None
    device: str | None = None
    engine: Engine = "fast"
    stage2_cells: Stage2Cells | None = None
    precision_check: bool = True
    precision_tolerance: float | None = DEFAULT_PRECISION_TOLERANCE

    def __post_init__(self) -> None:
        object.__setattr__(self, "tau", check_tau(self.tau))
        if not isinstance(self.precision_check, bool):
            raise ConfigError(f"precision_check must be True or False, got {self.precision_check!r}.")
        tolerance = self.precision_tolerance
        if isinstance(tolerance, float) and tolerance == math.inf:  # any UDS difference tolerated: no bound
            object.__setattr__(self, "precision_tolerance", tolerance := None)
        if tolerance is not None and (not finite_real(tolerance) or tolerance <= 0):
            raise ConfigError(
                f"precision_tolerance (--precision-tolerance) must be a number > 0 (a UDS difference) or None, "
                f"got {shown(tolerance)}."
            )
        if self.stage2_cells is not None:
            check_choice("stage2_cells (--stage2-cells)", self.stage2_cells, STAGE2_CELLS)
        check_choice("patch_scope (--scope)", self.patch_scope, SCOPES)
        check_choice("site (--site)", self.site, SITES)
        check_choice("engine (--engine)", self.engine, ENGINES)
        object.__setattr__(
            self,
            "batch_size",
            check_positive_int("batch_size (--batch-size)", self.batch_size, "choose from memory"),
        )
        if not isinstance(self.published_compat, bool):
            raise ConfigError(f"published_compat must be True or False, got {self.published_compat!r}.")
        if self.layers is not None:
            layers = list(self.layers) if isinstance(self.layers, (list, tuple, range)) else None
            if (
                not layers
                or any(isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0 for v in layers)
                or len(set(layers)) != len(layers)
            ):
                raise ConfigError(
                    f"layers must be a non-empty sequence of distinct layer numbers >= 0 (or None for "
                    f"all), got {self.layers!r}."
                )
            object.__setattr__(self, "layers", tuple(int(layer) for layer in layers))
        if self.dtype is not None and not _is_torch_dtype(self.dtype) and self.dtype not in DTYPE_NAMES:
            raise ConfigError(
                f"dtype (--dtype): Unknown dtype {self.dtype!r}; use one of {sorted(DTYPE_NAMES)}."
            )
        if self.device is not None:
            import torch

            try:
                torch.device(self.device)
            except (RuntimeError, TypeError):
                raise ConfigError(
                    f"device (--device) must be a torch device such as cpu, cuda or cuda:1, got "
                    f"{self.device!r}."
                ) from None

    def engine_spec(self, layers: tuple[int, ...]) -> EngineSpec:
        """The engines' view of these settings over the layers actually patched."""
        return EngineSpec(
            site=self.site, layers=tuple(layers), engine=self.engine, published_compat=self.published_compat
        )

    def with_stage2_cells(self, default: Stage2Cells) -> UDSConfig:
        """These settings with ``stage2_cells`` decided: ``default`` (the entry point's) when it is None."""
        if self.stage2_cells is not None:
            return self
        return dataclasses.replace(self, stage2_cells=default)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["layers"] = list(self.layers) if self.layers is not None else None
        return out


def as_config(config: Any) -> UDSConfig:
    """``config`` as the settings of an audit: a [`UDSConfig`][uds_lens.config.UDSConfig] as it is, None as the defaults.

    Raises:
        ConfigError: anything else (a dict of settings is ``UDSConfig(**settings)``).
    """
    if config is None:
        return UDSConfig()
    if not isinstance(config, UDSConfig):
        raise ConfigError(
            f"config must be a UDSConfig, got a {type(config).__name__} ({config!r:.80}): build one, e.g. "
            "UDSConfig(tau=0.1) (from a dict of settings: UDSConfig(**settings))."
        )
    return config


__all__ = [
    "DEFAULT_PRECISION_TOLERANCE",
    "DEFAULT_TAU",
    "DTYPE_NAMES",
    "ENGINES",
    "SCOPES",
    "SITES",
    "STAGE2_CELLS",
    "ConfigError",
    "DtypeName",
    "Engine",
    "EngineSpec",
    "Scope",
    "Site",
    "Stage2Cells",
    "UDSConfig",
    "as_config",
    "as_site",
    "check_choice",
    "check_positive_int",
    "check_tau",
]
