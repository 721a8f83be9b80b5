"""The first cell of every notebook: your checkpoints, or the embedded zoo when none are given, and an auditor on them.

A notebook in ``notebooks/`` runs on real checkpoints (``full``, ``retain``, one ``unlearned``, a forget set) when its
parameter cell names them, and on an embedded zoo otherwise: the one in ``zoo_dir`` when there is one (the test suite
points it at the test zoo), else the 8-layer notebook zoo (``size="notebook"``, deep enough for a layer story) built
there once, then reused. [`notebook_setup`][uds_lens.zoo.notebook.notebook_setup] makes that choice once
for all of them and returns the pieces they go on with: the [`UDSAuditor`][uds_lens.auditor.UDSAuditor] of full and
retain on the forget set, and, when asked to score, the unlearned model and its ``UDSResult``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import transformers

from uds_lens.auditor import UDSAuditor
from uds_lens.checkpoints.checkpoint import CheckpointRef
from uds_lens.checkpoints.loader import ModelArg, load_model
from uds_lens.config import UDSConfig
from uds_lens.data import DataArg
from uds_lens.plotting.export import keep_figures_in_notebooks
from uds_lens.results import UDSResult
from uds_lens.tl_compat import TransformerBridge
from uds_lens.zoo.build import build_zoo
from uds_lens.zoo.layout import Zoo, load_zoo
from uds_lens.zoo_manifest import MANIFEST_FILE

# The zoo's unlearned model a notebook shows when none is named (NPO: a method whose erasure is partial).
DEFAULT_UNLEARNED = "npo"


@dataclass
class NotebookSetup:
    """What a notebook works with after its setup cell.

    Attributes:
        zoo: the embedded zoo, or None when the notebook runs on its own checkpoints.
        full, retain, data: the checkpoints (directories or hub ids) and the forget set the auditor was built on.
        unlearned: the unlearned model's directory or hub id (a zoo name resolved to its directory).
        name: the unlearned model's name in results and figures (its directory's name).
        auditor: ``UDSAuditor(full, retain, data)`` with the notebook's device and example limit.
        unlearned_model: the loaded unlearned model (a ``TransformerBridge``), when the setup scored it.
        result: its ``UDSResult``, when the setup scored it.
    """

    zoo: Zoo | None
    full: ModelArg
    retain: ModelArg | None
    data: DataArg
    unlearned: CheckpointRef
    name: str
    auditor: UDSAuditor
    unlearned_model: TransformerBridge | None = None
    result: UDSResult | None = None

    def __str__(self) -> str:
        """The checkpoints in use and, once scored, the model UDS with its CI (what the setup cell prints)."""
        lines = [
            f"full: {self.full}",
            f"retain: {self.retain}",
            f"unlearned: {self.unlearned}",
            f"forget set: {self.data}",
        ]
        if self.result is not None:
            low, high = self.result.ci95
            lines.append(f"{self.name}: UDS = {self.result.uds:.3f} (95% CI {low:.3f} to {high:.3f})")
        return "\n".join(lines)

    def resolve(self, model: CheckpointRef) -> CheckpointRef:
        """A zoo model name -> its checkpoint directory; anything else (a directory, a hub id) as it is."""
        if self.zoo is not None and isinstance(model, str) and model in self.zoo.names():
            return self.zoo.path(model)
        return model


def notebook_setup(
    full: ModelArg | None = None,
    retain: ModelArg | None = None,
    unlearned: CheckpointRef | None = None,
    data: DataArg = None,
    *,
    zoo_dir: str | Path,
    device: str | None = None,
    limit: int | None = None,
    progress: bool = True,
    score: bool = True,
    zoo_size: str = "notebook",
) -> NotebookSetup:
    """Resolve a notebook's parameters, build its auditor and (by default) score its unlearned model.

    Args:
        full: the model trained with the forget set (patch target); None = the zoo's ``full`` (and then ``retain``
            and ``data`` are the zoo's too).
        retain: the model that never saw the forget set (Stage-1 source).
        unlearned: the unlearned model: a zoo name, a directory or a hub id; None = the zoo's NPO model (or its first
            unlearned model).
        data: the forget set (JSON / JSONL records, or a hub dataset id).
        zoo_dir: where the embedded zoo is, or is built when it is not there yet.
        device: None = cuda when available, else cpu.
        limit: score only the first ``limit`` examples (None = all).
        progress: progress bars while scoring.
        score: load the unlearned model and score it (``unlearned_model``, ``result``).
        zoo_size: the size built when ``zoo_dir`` holds no zoo (``"notebook"``: 8 layers, no meta-evaluation pools).

    Returns:
        The [`NotebookSetup`][uds_lens.zoo.notebook.NotebookSetup] (``print`` it to show the checkpoints and the score).
    """
    # A notebook cell should show what it computes: no tqdm-without-ipywidgets warning, no transformers chatter.
    warnings.filterwarnings("ignore", message="IProgress not found")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    # Figures stored as HTML too: the notebook keeps them when rendered to HTML, shared or built into the docs.
    keep_figures_in_notebooks()
    zoo = None
    if full is None:
        zoo_dir = Path(zoo_dir)
        zoo = (
            load_zoo(zoo_dir)
            if (zoo_dir / MANIFEST_FILE).exists()
            else build_zoo(zoo_dir, size=zoo_size, pools=False)
        )
        full, retain, data = zoo.path("full"), zoo.path("retain"), zoo.forget_path
        if unlearned is None:
            names = zoo.names(role="unlearned")
            unlearned = DEFAULT_UNLEARNED if DEFAULT_UNLEARNED in names else names[0]
    if unlearned is None:
        raise ValueError(
            "Set UNLEARNED (a directory or hub id) when FULL is set: there is no zoo to pick one from."
        )
    auditor = UDSAuditor(full, retain, data, config=UDSConfig(device=device), limit=limit, progress=progress)
    setup = NotebookSetup(zoo, full, retain, data, unlearned, Path(str(unlearned)).name, auditor)
    setup.unlearned = setup.resolve(unlearned)
    if score:
        setup.unlearned_model = load_model(setup.unlearned, device=setup.auditor.device)
        setup.result = setup.auditor.score(setup.unlearned_model, name=setup.name)
    return setup
