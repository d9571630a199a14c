"""bench/gpu_run.sh: every batch its header describes is accepted on the command line and has a
function (`batch_NAME`, or `build`, which every batch runs first), and every accepted one is
described."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "gpu_run.sh")


def accepted_batches(text):
    """The batch names the script accepts on its command line (its BATCHES list)."""
    return re.search(r'^BATCHES="([^"]*)"', text, re.MULTILINE).group(1).split()


def test_described_accepted_and_defined():
    text = open(SCRIPT).read()
    header = text.split("\nset -uo pipefail", 1)[0]
    described = re.findall(r"^#   ([a-z]+)\s{2,}\S", header, re.MULTILINE)
    accepted = accepted_batches(text)
    defined = set(re.findall(r"^batch_([a-z]+)\(\)", text, re.MULTILINE)) | {"build"}
    assert described, "no batch descriptions found in the header"
    assert sorted(described) == sorted(accepted), (described, accepted)
    assert set(accepted) <= defined, set(accepted) - defined
    # ...and the dispatch loop runs each of them.
    loop = re.search(r"case \$b in(.*?)esac", text, re.DOTALL).group(1)
    runs = set(re.findall(r"[a-z]+", loop.split(")", 2)[1])) | {"build"}
    assert set(accepted) <= runs, set(accepted) - runs


def test_readme_names_every_batch():
    text = open(SCRIPT).read()
    accepted = accepted_batches(text)
    readme = open(os.path.join(ROOT, "README.md")).read()
    part = readme.split("bash bench/gpu_run.sh BATCH...", 1)[1].split("\n\n", 1)[0]
    named = set(re.findall(r"`([a-z]+)`", part))
    assert set(accepted) <= named, set(accepted) - named
