"""Probe of issue 27's items (never silently wrong, part two) on whichever uds_lens is first on PYTHONPATH: one line
per item, on the tiny test checkpoints. Run it against this tree and against an export of main to compare:

    PYTHONPATH=. python experiments/probe_issue27.py
    git archive 41877c4 | tar -x -C /tmp/main && PYTHONPATH=/tmp/main python experiments/probe_issue27.py
"""

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import unicodedata
import warnings
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
warnings.simplefilter("ignore")
logging.disable(logging.INFO)
from conftest import Tiny  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import uds_lens  # noqa: E402
from uds_lens.scoring import score_models  # noqa: E402

TREE = str(Path(uds_lens.__file__).parents[1])
root = Path(tempfile.mkdtemp())
t = Tiny(root / "tiny")
print("tree", TREE)


def score(out, cache, retain=None, **kw):
    return score_models(
        t.full,
        retain or t.retain,
        {"u": t.unlearned},
        t.data,
        out_dir=out,
        cache_dir=cache,
        progress=False,
        **kw,
    )["u"]


def cli(*args, stdin=""):
    proc = subprocess.run(
        [sys.executable, "-c", "from uds_lens.cli import main; main()", *map(str, args)],
        input=stdin,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": TREE},
    )
    return proc


def shift(path):
    with safe_open(str(path), framework="pt") as h:
        meta = dict(h.metadata())
        tensors = {k: h.get_tensor(k) for k in h.keys()}
    tensors["s1"] = tensors["s1"] - 5
    save_file(tensors, str(path), metadata=meta)


# 1 tampered cache
cache = root / "c1"
truth = score(root / "o1a", cache).uds
cfile = next(cache.glob("s1_*.safetensors"))
good = cfile.read_bytes()
shift(cfile)
tampered = score(root / "o1b", cache).uds
print(f"1a tampered S1 cache: true UDS {truth:.4f}, with scores shifted -5 (header intact) {tampered:.4f}")
cfile = next(cache.glob("s1_*.safetensors"))
cfile.write_bytes(good)
shift(cfile)  # a bad cache the run accepts? (on main: yes)
bad = score(root / "o1c", cache)
for f in cache.glob("s1_*.safetensors"):
    f.unlink()
cache.mkdir(exist_ok=True)
(cache / cfile.name).write_bytes(good)
again = score(root / "o1c", cache)
print(
    f"1b repaired cache: result computed from it {bad.uds:.4f}; rerun after repair {again.uds:.4f} "
    f"reused={again.meta.get('reused')!r} recomputed={again.meta.get('recomputed', '')[:60]!r}"
)

# 2 auto_map
for which in ("config", "tokenizer"):
    ck, marker = root / f"custom_{which}", root / f"ran_{which}"
    shutil.copytree(t.full, ck)
    code = f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
    if which == "config":
        c = json.loads((ck / "config.json").read_text())
        c.update(model_type="xllama", auto_map={"AutoConfig": "configuration_x.XConfig"})
        (ck / "config.json").write_text(json.dumps(c))
        (ck / "configuration_x.py").write_text(
            code
            + "from transformers import LlamaConfig\nclass XConfig(LlamaConfig):\n    model_type='xllama'\n"
        )
    else:
        c = json.loads((ck / "tokenizer_config.json").read_text())
        c.update(
            tokenizer_class="XTokenizer", auto_map={"AutoTokenizer": ["tokenization_x.XTokenizer", None]}
        )
        (ck / "tokenizer_config.json").write_text(json.dumps(c))
        (ck / "tokenization_x.py").write_text(
            code
            + "from transformers import PreTrainedTokenizerFast\nclass XTokenizer(PreTrainedTokenizerFast):\n    pass\n"
        )
    proc = cli(
        "score",
        "--full",
        ck,
        "--no-retain",
        "--unlearned",
        t.unlearned,
        "--data",
        t.data,
        "--out",
        root / f"o2{which}",
        stdin="y\n" * 20,
    )
    print(
        f"2 auto_map in {which} (stdin says y): exit {proc.returncode}, code ran={marker.exists()}, "
        f"prompt shown={'[y/N]' in proc.stdout + proc.stderr}, stderr lines={len(proc.stderr.strip().splitlines())}"
    )

# 3 pickled bin, sweep name
ck = root / "pickled"
ck.mkdir()
shutil.copy(t.full / "config.json", ck)
import torch  # noqa: E402


class P:
    def __reduce__(self):
        return (os.system, ("true",))


torch.save({"w": P()}, ck / "pytorch_model.bin")
proc = cli(
    "score", "--full", t.full, "--retain", t.retain, "--unlearned", ck, "--data", t.data, "--out", root / "o3"
)
print(
    f"3a pickled-only pytorch_model.bin: exit {proc.returncode}, stderr lines {len(proc.stderr.strip().splitlines())}, "
    f"Traceback={'Traceback' in proc.stderr}"
)
from uds_lens.sweep.driver import sweep  # noqa: E402

try:
    sweep(
        t.full,
        t.retain,
        t.data,
        root / "o3s",
        {"sweep.csv": str(t.unlearned)},
        use_ray=False,
        progress=False,
        cache_dir=root / "c3",
    )
    print("3b sweep model named sweep.csv: no refusal")
except Exception as e:  # noqa: BLE001
    print(f"3b sweep model named sweep.csv: {type(e).__name__}: {str(e)[:90]}")

# 4 retain vs other retain into the same out
out4 = root / "o4"
a = score(out4, root / "c4")
try:
    b = score(out4, root / "c4", retain=t.unlearned)
    print(
        f"4a second run (other retain) into the same --out: accepted, first result gone "
        f"(saved uds {json.loads((out4 / 'u' / 'summary.json').read_text())['uds']:.4f} vs first {a.uds:.4f})"
    )
except Exception as e:  # noqa: BLE001
    print(f"4a second run (other retain) into the same --out: {type(e).__name__}: {str(e)[:110]}")
ex = out4 / "u" / "examples.csv"
ex.write_text(ex.read_text().replace("scored", "no_ke", 1))
proc = cli(
    "score",
    "--full",
    t.full,
    "--retain",
    t.retain,
    "--unlearned",
    f"u={t.unlearned}",
    "--data",
    t.data,
    "--out",
    out4,
    "--cache-dir",
    root / "c4",
)
line = [x for x in (proc.stdout + proc.stderr).splitlines() if "recomput" in x]
print(
    f"4b rerun over a damaged result: exit {proc.returncode}; says why: {line[0][:100] if line else 'nothing'}"
)

# 5 sweep exit status and values
ml = root / "models.csv"
ml.write_text(f"u,{t.unlearned}\nbroken,{root / 'nope'}\n")
for _attempt in (1, 2):  # scored, then reused
    proc = cli(
        "sweep",
        "--full",
        t.full,
        "--retain",
        t.retain,
        "--data",
        t.data,
        "--out",
        root / "o5",
        "--models",
        ml,
        "--workers",
        "1",
        "--cache-dir",
        root / "c5",
    )
import pandas as pd  # noqa: E402

row = pd.read_csv(root / "o5" / "sweep.csv").set_index("name").loc["u"]
summ = json.loads((root / "o5" / "u" / "summary.json").read_text())
print(
    f"5a sweep with a failed row: exit {proc.returncode}; 5b reused row uds - summary.json uds = "
    f"{row['uds'] - summ['uds']:.3g} (status {row['status']})"
)
proc = cli("score", "--help")
import re  # noqa: E402

print(
    f"5c --help names float16 / fp16: {bool(re.search(r'(?<!b)float16', proc.stdout))} / {'fp16' in proc.stdout}"
)
from uds_lens.checkpoints.loader import load_tokenizer  # noqa: E402
from uds_lens.data import Example, encode_one  # noqa: E402

tok = load_tokenizer(t.tokenizer)
d, c = unicodedata.normalize("NFD", "Café"), unicodedata.normalize("NFC", "Café")
ex = Example(
    idx=1,
    question="Where?",
    answer=f"They met at the {c} Lumen.",
    prefix="They met at the",
    entity=f"{d} Lumen",
)
r = encode_one(ex, tok)
print(f"5d entity 'Café' (combining accent) in answer 'Café' (precomposed): {getattr(r, 'reason', 'found')}")
proc = cli(
    "score",
    "--full",
    t.full,
    "--retain",
    t.retain,
    "--unlearned",
    f"npo=lr=1e-5={t.unlearned}",
    "--data",
    t.data,
    "--out",
    root / "o5e",
    "--cache-dir",
    root / "c5",
)
print(
    f"5e --unlearned npo=lr=1e-5=PATH: exit {proc.returncode}, dirs {sorted(p.name for p in (root / 'o5e').glob('*') if p.is_dir())}"
    f" {proc.stderr.strip().splitlines()[-1][:80] if proc.returncode else ''}"
)

# 6 line buffering, report
code = "import sys, uds_lens.cli as c\nc.app = lambda: print(sys.stdout.line_buffering)\nc.main()"
proc = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": TREE}
)
print(f"6a stdout line-buffered in a pipe: {proc.stdout.strip()}")
proc = cli(
    "score",
    "--full",
    t.full,
    "--retain",
    t.retain,
    "--unlearned",
    f"zeta={t.unlearned}",
    "--unlearned",
    f"alpha={t.full}",
    "--data",
    t.data,
    "--out",
    root / "o6",
    "--cache-dir",
    root / "c5",
)
from uds_lens.plotting.report import write_report  # noqa: E402

page = write_report(root / "o6").read_text()
table = page[page.index("<table") : page.index("</table>")]
rows = [re.findall(r"<td>(.*?)</td>", row)[:2] for row in table.split("<tr")[2:]]
print(f"6b report table (model, role): {rows}; terminal order zeta, alpha")
