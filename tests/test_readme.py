"""The documents: the README's CPU example runs as written, links resolve, nothing cites a file
outside the repository, and the generated sections match what `dmbench report` makes from the
committed CSVs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dmbench.collected import collect
from dmbench.report import HEADLINE, TABLES, headline_markdown, tables_markdown

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "results").rglob("*.md"))]
# Every file of the repository by name, for documents that name one without its folder.
REPO_FILE_NAMES = {path.name for path in ROOT.rglob("*") if ".git" not in path.parts}
SETUP_COMMANDS = (
    'pip install torch==2.13.0 && pip install -e ".[test,hf]" && dmbench fwd sweeps/smoke.yaml',
    "TRITON_INTERPRET=1 python -m pytest -q -n 2",
)


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _section(text: str, markers: tuple[str, str]) -> str:
    return text.split(markers[0] + "\n", 1)[1].split(markers[1], 1)[0]


def test_setup_commands_are_in_the_readme():
    """.ci/run installs and tests the way the README says; these lines must stay as they are."""
    text = README.read_text()
    for command in SETUP_COMMANDS:
        assert f"\n{command}\n" in text, command


@pytest.mark.interpreter
def test_cpu_example_runs_as_written(tmp_path):
    cpu = [b for b in _python_blocks(README.read_text()) if 'TRITON_INTERPRET"] = "1"' in b]
    assert len(cpu) == 1
    script = tmp_path / "example.py"
    script.write_text(cpu[0])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    # The comment in the example says what it prints.
    assert done.stdout.split() == ["torch.Size([1,", "17,", "4,", "40])", "torch.Size([1,", "4,",
                                   "17])", "torch.Size([1,", "2,", "1,", "33])"]


# Run before the README's transformers recipe: its inputs, and a two-layer DogeConfig in place
# of the default one (32 layers take a minute under the interpreter).
RECIPE_PRELUDE = """\
import os
os.environ["TRITON_INTERPRET"] = "1"
import functools, torch, transformers
transformers.DogeConfig = functools.partial(
    transformers.DogeConfig, vocab_size=97, hidden_size=64, intermediate_size=96,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, keep_window_size=8)
ids = torch.randint(0, 97, (2, 12))
padding = torch.ones(2, 12, dtype=torch.long)
padding[1, 9:] = 0
"""


@pytest.mark.interpreter
def test_transformers_recipe_runs_as_written(tmp_path):
    """The five-line recipe trains a dmattn model: every parameter gets a gradient."""
    pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    recipe = [b for b in _python_blocks(README.read_text()) if ".register()" in b]
    assert len(recipe) == 1 and len(recipe[0].strip().splitlines()) == 5
    script = tmp_path / "recipe.py"
    script.write_text(RECIPE_PRELUDE + recipe[0] +
                      "print(model.config._attn_implementation,\n"
                      "      all(p.grad is not None for p in model.parameters()))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["dmattn", "True"]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(document):
    prose = re.sub(r"`[^`]*`", "", document.read_text())  # code spans are not links
    for target in re.findall(r"\]\(([^)#\s]+)\)", prose):
        if "://" in target:
            continue
        assert (document.parent / target).exists(), f"{document.name}: {target}"


@pytest.mark.parametrize("document", DOCUMENTS + sorted((ROOT / "sweeps").glob("*.yaml")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_citation_of_files_outside_the_repo(document):
    """A reader can open every document a document names: each ``*.md`` it names is a file of
    the repository (beside it, from the root, or by name alone), and each section sign (``§N``)
    names a numbered section ("## N.") of the document itself."""
    text = document.read_text()
    for name in re.findall(r"[A-Za-z0-9_./<>-]*[A-Za-z0-9_-]\.md\b", text):
        found = ((document.parent / name).exists() or (ROOT / name.lstrip("/")).exists()
                 or Path(name).name in REPO_FILE_NAMES)
        assert found, f"{document.name} names {name}, which is not in the repository"
    sections = set(re.findall(r"^#+ (\d+)\.", text, flags=re.M))
    for number in re.findall(r"§\s*(\d+)", text):
        assert number in sections, f"{document.name} cites §{number}, not a section of its own"


def test_generated_sections_match_the_committed_csvs():
    """README's headline (from the H200 folder) and each GPU folder's tables are `dmbench report`
    output, never typed."""
    folder = ROOT / "results" / "nvidia-h200"
    collected = collect(sorted(folder.glob("*.csv")))
    link = "results/nvidia-h200/README.md"
    assert _section(README.read_text(), HEADLINE) == headline_markdown(collected, link)
    for gpu in ("nvidia-h200", "nvidia-h100-80gb-hbm3"):
        folder = ROOT / "results" / gpu
        assert _section((folder / "README.md").read_text(), TABLES) == tables_markdown(
            collect(sorted(folder.glob("*.csv"))))
