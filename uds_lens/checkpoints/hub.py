"""The Hugging Face hub, asked at most once: whether it answers, and what a hub id resolves to offline.

A hub id is looked up once: when the hub cannot be reached (one request, `hub_reachable`), a checkpoint fails with
one line, or is read from the local Hugging Face cache where the model is there, instead of `transformers` retrying
for half a minute. `hub_revision` reads the commit a hub id resolves to in that cache (a hub checkpoint's identity).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from uds_lens.checkpoints.folder import ModelLoadError

logger = logging.getLogger(__name__)

# How long one hub request may take, and how long its answer is trusted (a notebook that lost its connection
# recovers without a restart).
HUB_TIMEOUT_S = 10.0
HUB_ANSWER_TTL_S = 60.0
_hub_answers: dict[str, tuple[float, str | None]] = {}


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` is set: the hub is never contacted."""
    return os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")


def hub_reachable() -> str | None:
    """Whether the Hugging Face hub answers: None when it does, else why not, one line.

    One request (a ``HEAD`` of the endpoint, ``HUB_TIMEOUT_S`` at most; any HTTP status counts as an answer), its
    answer kept for ``HUB_ANSWER_TTL_S``: ``transformers`` itself retries an unreachable hub five times with backoff
    (about half a minute, each retry logged), which a checkpoint argument that is a typo should not cost.
    """
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    endpoint = constants.ENDPOINT
    now = time.monotonic()
    cached = _hub_answers.get(endpoint)
    if cached is not None and now - cached[0] < HUB_ANSWER_TTL_S:
        return cached[1]
    problem: str | None = None
    try:
        get_session().head(endpoint, timeout=HUB_TIMEOUT_S)
    except Exception as err:  # any transport error: DNS, refused, timeout, proxy
        problem = f"{type(err).__name__}: {_first_line(str(err))}"
    _hub_answers[endpoint] = (now, problem)
    return problem


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def hub_or_cache(model_id: str) -> bool:
    """True to fetch ``model_id`` from the hub, False to read it from the local Hugging Face cache (the hub cannot
    be reached, or HF_HUB_OFFLINE is set, and the cache holds its config).

    Raises:
        ModelLoadError: the hub cannot be reached and the cache does not hold the model: one line, after one try.
    """
    if hub_offline():
        return False  # transformers reads the cache, or fails naming HF_HUB_OFFLINE (loader.loader_errors)
    problem = hub_reachable()
    if problem is None:
        return True
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(model_id, "config.json"), str):
        logger.warning(
            "The Hugging Face hub cannot be reached (%s); reading %s from the local cache.", problem, model_id
        )
        return False
    raise ModelLoadError(
        f"Cannot load {model_id!r}: there is no local path {Path(model_id).absolute()}, and as a Hugging Face hub id it "
        f"can be neither fetched (the hub cannot be reached: {problem}) nor read from the local cache. Pass an "
        "existing checkpoint directory or .gguf file (check the path), or connect to the hub."
    )


def hub_error(model_id: str, err: Exception) -> ModelLoadError:
    """One line for a hub id whose files could not be fetched."""
    return ModelLoadError(
        f"Could not load {model_id!r}: it is not a local directory, and fetching it from the Hugging Face hub failed "
        f"({type(err).__name__}: {err}). "
        + (
            "HF_HUB_OFFLINE is set, so the hub is not contacted. "
            if hub_offline()
            else "This machine may have no access to the hub (set HF_HUB_OFFLINE=1 to fail fast). "
        )
        + "Pass a local checkpoint directory instead (e.g. one saved with `save_pretrained`, or a zoo model from "
        "`uds-lens zoo build`)."
    )


def hub_revision(model_id: str) -> str | None:
    """The commit a hub id resolves to in the local Hugging Face cache (offline; None when not cached)."""
    from huggingface_hub.constants import HF_HUB_CACHE

    ref = Path(HF_HUB_CACHE) / f"models--{model_id.replace('/', '--')}" / "refs" / "main"
    return ref.read_text().strip() if ref.is_file() else None


__all__ = [
    "HUB_ANSWER_TTL_S",
    "HUB_TIMEOUT_S",
    "hub_error",
    "hub_offline",
    "hub_or_cache",
    "hub_reachable",
    "hub_revision",
]
