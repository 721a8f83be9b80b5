"""uds_lens/zoo/notebook.py: the notebooks' setup call (its zoo and checkpoint paths run in
tests/integration/test_notebooks.py and test_pretrained_llama.py)."""

from __future__ import annotations

import pytest

from uds_lens.zoo.notebook import notebook_setup


def test_own_checkpoints_need_an_unlearned_model(tmp_path):
    with pytest.raises(ValueError, match="Set UNLEARNED"):
        notebook_setup("full_dir", "retain_dir", None, "forget.json", zoo_dir=tmp_path)
