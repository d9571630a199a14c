"""bench/gpu_run.sh: every batch its header describes is accepted on the command line and has a
function (`batch_NAME`, or `build`, which every batch runs first), and every accepted one is
described."""

import os
import re
import subprocess

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


def script_function(name):
    """The text of gpu_run.sh's multi-line shell function `name` (from `name() {` to the `}`
    that starts a line)."""
    text = open(SCRIPT).read()
    return re.search(r"^%s\(\) \{.*?^\}" % name, text, re.MULTILINE | re.DOTALL).group(0)


def tree_id(repo):
    """gpu_run.sh's tree_id, run alone in `repo`."""
    return subprocess.run(["bash", "-c", script_function("tree_id") + "\ntree_id"], cwd=repo,
                          check=True, capture_output=True, text=True).stdout.strip()


def git_in(repo):
    """git(*args) in `repo` (an identity given, output stripped)."""

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              cwd=repo, check=True, capture_output=True, text=True).stdout.strip()

    return git


def test_tree_id_names_the_files_not_head(tmp_path):
    """env.log's "files: tree" is the commit's tree for that commit's files, another id when the
    files differ from HEAD (a checkout copied with another commit's .git), and the checkout's own
    index is left as it was."""

    git = git_in(tmp_path)

    git("init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    (tmp_path / ".gitignore").write_text("ignored/\n")
    (tmp_path / "ignored").mkdir()
    (tmp_path / "ignored" / "big.bin").write_text("not part of the tree\n")
    git("add", "-A")
    git("commit", "-qm", "first")
    assert tree_id(tmp_path) == git("rev-parse", "HEAD^{tree}")
    (tmp_path / "a.txt").write_text("two\n")
    (tmp_path / "b.txt").write_text("new\n")
    status = git("status", "--porcelain")
    changed = tree_id(tmp_path)
    assert changed and changed != git("rev-parse", "HEAD^{tree}")
    assert git("status", "--porcelain") == status  # the index is untouched
    git("add", "-A")
    git("commit", "-qm", "second")
    assert changed == git("rev-parse", "HEAD^{tree}")


def test_head_line_says_whether_head_is_these_files(tmp_path):
    """env.log's "head:" line names the copy's .git HEAD and says whether the files are its: a
    copied checkout may carry an older .git, whose HEAD then names no commit of the run."""
    funcs = script_function("tree_id") + "\n" + script_function("head_line")

    def head_line(repo):
        return subprocess.run(["bash", "-c", funcs + '\nhead_line "$(tree_id)"'], cwd=repo,
                              check=True, capture_output=True, text=True).stdout.strip()

    git = git_in(tmp_path)

    git("init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    git("add", "-A")
    git("commit", "-qm", "first")
    head = git("log", "-1", "--oneline")
    assert head_line(tmp_path) == "head: %s (these files)" % head
    (tmp_path / "a.txt").write_text("two\n")
    assert head_line(tmp_path) == "head: %s (not these files: see the tree below)" % head
    empty = tmp_path / "empty"
    empty.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=empty, check=True)
    assert head_line(empty) == "head: none"


def test_peer_trees_are_ignored(tmp_path):
    """`peers/` (DeepEP's sources, a base tree for `ab`, one-off scripts: carried to the GPU
    machine, never committed) is ignored by the repository's own .gitignore, not only by a
    checkout's .git/info/exclude: the GPU machine's copy has no such exclude, and env.log's tree
    id would then count the carried trees as files. Checked in a fresh repository holding only
    that .gitignore, so no local exclude answers for it."""
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / ".gitignore").write_text(open(os.path.join(ROOT, ".gitignore")).read())
    for path in ("peers/deepep-src/tests/test_low_latency.py", "peers/base-main/CMakeLists.txt",
                 "peers/cmd.sh"):
        ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=tmp_path)
        assert ignored.returncode == 0, path
    kept = subprocess.run(["git", "check-ignore", "-q", "--no-index", "src/peers.cc"],
                          cwd=tmp_path)
    assert kept.returncode == 1


def test_main_build_skipped_only_where_no_batch_uses_it():
    """The main build runs unless every batch given builds its own tree: htrace, probe, and
    trace with EPX_TRACE_PARTS=ll (ll's trace alone: no benchmark of the main build)."""
    text = open(SCRIPT).read()
    funcs = [script_function("main_build"),
             re.search(r"^trace_parts\(\) \{.*\}$", text, re.MULTILINE).group(0)]
    stubs = "do_build() { echo BUILD; }\nskip() { echo SKIP; }\n"

    def run(batches, parts=None):
        env = {k: v for k, v in os.environ.items() if k != "EPX_TRACE_PARTS"}
        if parts is not None:
            env["EPX_TRACE_PARTS"] = parts
        script = stubs + "\n".join(funcs) + "\nmain_build " + " ".join(batches)
        return subprocess.run(["bash", "-c", script], env=env, check=True, capture_output=True,
                              text=True).stdout.strip()

    assert run(["trace"]) == "BUILD"  # default parts: ht and the overlap bench's cuBLAS check
    assert run(["trace"], "ll") == "SKIP"
    assert run(["trace"], "ll ht") == "BUILD"
    assert run(["trace", "ab"], "ll") == "BUILD"
    assert run(["htrace", "probe"]) == "SKIP"
    assert run(["probe", "tests"]) == "BUILD"


def test_main_build_makes_only_the_targets_its_batches_run(tmp_path):
    """`ab` (with or without `build`) builds only this tree's ll bench, and its Python extension
    where DeepEP's harness or the host-time rows run through the drop-in (what ab builds of the
    base tree too); `tests` with EPX_GTEST only the binaries it names (its filters passed as given),
    `ncu` the ll bench (and the extension for the hooked halves); any other batch builds every
    target. epx_configure_and_build passes the targets to `cmake --build` and builds all without
    them."""
    funcs = script_function("ab_targets") + "\n" + script_function("main_targets")

    def targets(batches, **env):
        base = {k: v for k, v in os.environ.items()
                if k not in ("EPX_DEEPEP_TESTS", "EPX_AB_OVERHEAD", "EPX_GTEST", "EPX_NCU_HOOK")}
        script = funcs + "\nmain_targets " + " ".join(batches)
        return subprocess.run(["bash", "-c", script], env={**base, **env}, check=True,
                              capture_output=True, text=True).stdout.strip()

    assert targets(["ab"]) == "epx_ll_gpu_bench"
    assert targets(["build", "ab"], EPX_DEEPEP_TESTS="/x/tests") == "epx_ll_gpu_bench _epx"
    assert targets(["ab"], EPX_AB_OVERHEAD="2") == "epx_ll_gpu_bench _epx"
    assert targets(["ab"], EPX_AB_OVERHEAD="0") == "epx_ll_gpu_bench"
    assert targets(["build"]) == ""
    assert targets(["ab", "tests"]) == ""
    assert targets(["pytest", "ab"]) == ""
    gtest = "gpu_ll_wait_stats_gpu_test=* gpu_ll_gpu_test=*-*Logfmt*"
    assert targets(["tests"], EPX_GTEST=gtest) == "gpu_ll_wait_stats_gpu_test gpu_ll_gpu_test"
    assert targets(["ab", "tests"], EPX_GTEST=gtest, EPX_DEEPEP_TESTS="/x/tests") == (
        "epx_ll_gpu_bench _epx gpu_ll_wait_stats_gpu_test gpu_ll_gpu_test")
    assert targets(["tests", "pytest"], EPX_GTEST=gtest) == ""
    assert targets(["ncu"]) == "epx_ll_gpu_bench"
    assert targets(["ncu"], EPX_NCU_HOOK="1") == "epx_ll_gpu_bench _epx"
    assert targets(["ab", "ncu"]) == "epx_ll_gpu_bench"
    # batch_tests passes each filter as given, even one that names a file of the working
    # directory (a stub gtest prints its binary and filter).
    (tmp_path / "gpu_x_test=a").write_text("")
    script = ('gtest() { echo "$2 $3"; }\n' + script_function("batch_tests") +
              f"\ncd {tmp_path}\nbatch_tests")
    r = subprocess.run(["bash", "-c", script],
                       env={**os.environ, "EPX_GTEST": "gpu_x_test=* gpu_y_test=A.*-*B*"},
                       check=True, capture_output=True, text=True)
    assert r.stdout.splitlines() == ["gpu_x_test *", "gpu_y_test A.*-*B*"]

    # epx_configure_and_build with a stub cmake that records its arguments.
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "cmake.log"
    (bindir / "cmake").write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    (bindir / "cmake").chmod(0o755)
    build = tmp_path / "build"
    build.mkdir()
    (build / "CMakeCache.txt").write_text("")
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "EPX_BUILD_DIR": str(build),
           "EPX_WITH_CUDA": "OFF"}
    script = ("source scripts/common.sh\nepx_python_ready() { return 1; }\n"
              'epx_configure_and_build "a b"\nepx_configure_and_build')
    subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, check=True, capture_output=True)
    builds = [ln for ln in log.read_text().splitlines() if ln.startswith("--build")]
    assert len(builds) == 2, builds
    assert builds[0].endswith("--target a b"), builds
    assert "--target" not in builds[1], builds


def test_ab_sides_put_each_tree_first_in_every_other_round():
    """ab's rounds: the base first in odd rounds, this tree ("head") first in even ones, so an even
    number of rounds runs each tree first as often."""
    script = script_function("ab_sides") + "\nfor r in 1 2 3 4; do ab_sides base $r; done"
    r = subprocess.run(["bash", "-c", script], cwd=ROOT, check=True, capture_output=True,
                       text=True)
    assert r.stdout.splitlines() == ["base head", "head base", "base head", "head base"]


def test_ab_overhead_alternates_the_trees_each_on_its_own_package(tmp_path):
    """ab with EPX_AB_OVERHEAD=N: bench_overhead.py --breakdown through the base tree's package
    and this tree's in turn (the base first in odd rounds, this tree in even ones), N times, each
    process with only that tree's python/ on PYTHONPATH, and its torch bridge line and layers
    printed with its side's label."""
    src = tmp_path / "base.src"
    (src / "python").mkdir(parents=True)
    out = tmp_path / "out"
    out.mkdir()
    # step NAME LIMIT SHOW CMD...: records the command's PYTHONPATH and leaves a log with rows.
    stubs = ('step() { local name=$1; shift 3; for a in "$@"; do case $a in PYTHONPATH=*) '
             'echo "$name $a";; esac; done; '
             'printf "T=1 bridge\\n| compat pair (x) | 1.0 |\\n| other | 2 |\\n" '
             '> "$OUT/$name.log"; }\n'
             'pin() { echo env; }\n')
    script = (stubs + script_function("ab_sides") + "\n" + script_function("ab_overhead") +
              f"\nab_overhead base {src} 2")
    env = dict(os.environ, OUT=str(out), EPX_PYTHON="python3")
    r = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, check=True,
                       capture_output=True, text=True)
    lines = r.stdout.strip().splitlines()
    base, head = f"PYTHONPATH={src}/python", f"PYTHONPATH={ROOT}/python"
    want = []
    for n, order in ((1, (("base", base), ("head", head))), (2, (("head", head), ("base", base)))):
        for side, path in order:
            want += [f"ab.overhead.{side}.{n} {path}", f"  [{side}] T=1 bridge",
                     f"  [{side}] | compat pair (x) | 1.0 |"]
    assert lines == want, lines


def test_ab_keeps_the_base_build_only_for_the_same_sources(tmp_path):
    """ab's base build directory is reused only when the base's files are the ones it was built
    from (their bytes, not their times: `git archive` gives a later base older times than the
    previous base's objects, and ninja would then run the previous base's binaries)."""
    src, build = tmp_path / "src", tmp_path / "build"
    src.mkdir()
    (src / "a.cu").write_text("one\n")
    # ab's order: keep or remove the build, build (here: create obj), then mark it complete
    script = (script_function("src_stamp") + "\n" + script_function("ab_keep_build") +
              f'\nab_keep_build {src} {build} && touch {build}/obj && '
              f'mv {build}/.epx-ab-src.new {build}/.epx-ab-src')

    def build_once():
        subprocess.run(["bash", "-c", script], cwd=ROOT, check=True)
    build_once()
    assert (build / "obj").exists()
    (build / "obj").write_text("kept")
    os.utime(src / "a.cu", (0, 0))  # same bytes, another time: kept
    build_once()
    assert (build / "obj").read_text() == "kept"
    (src / "a.cu").write_text("two\n")
    os.utime(src / "a.cu", (0, 0))  # other bytes, an older time: removed and built again
    build_once()
    assert (build / "obj").read_text() == ""
    # a build that never completed (no stamp moved in place) is not reused either
    (build / "obj").write_text("partial")
    (build / ".epx-ab-src").unlink()
    build_once()
    assert (build / "obj").read_text() == ""


def test_ncu_hook_samples_the_halves_asked_for(tmp_path):
    """ncu with EPX_NCU_HOOK=1: for each T and kernel name, the receive half (launch 2W + 1 of
    that name, W the warm-up pairs) by default, and with EPX_NCU_HALVES="send recv" the send half
    (launch 2W) before it, each into its own report; an unknown half is one skip and no sample."""
    out = tmp_path / "out"
    (tmp_path / "python" / "epx").mkdir(parents=True)
    (tmp_path / "python" / "epx" / "_epx.cpython-311-x86_64-linux-gnu.so").write_text("")
    stubs = ('ncu_disasm() { return 1; }\n'
             'ncu_sample() { local name=$2 rep=$3; shift 4; '
             'echo "$name $(basename "$rep") $*" | sed "s/ --cache-control.*//"; }\n'
             'skip() { echo "skip $1: $2"; }\n'
             'step() { :; }\n')
    script = (stubs + script_function("epx_extension") + "\n" + script_function("batch_ncu_hook")
              + "\nbatch_ncu_hook ncu")

    def run(**env):
        base = {k: v for k, v in os.environ.items() if k != "EPX_NCU_HALVES"}
        r = subprocess.run(["bash", "-c", script], cwd=tmp_path, check=False,
                           capture_output=True, text=True,
                           env=dict(base, OUT=str(out), EPX_PYTHON="python3",
                                    EPX_NCU_TOKENS="128 1", **env))
        return r.stdout.splitlines()

    def line(name, launch):
        kernel = name.split("_")[0]
        return (f"ncu.hook_{name} ncu_hook_{name} -k regex:^{kernel} --launch-skip {launch} "
                f"--launch-count 1")

    recv = [line(f"{k}_t{t}", 9) for t in (128, 1) for k in ("dispatch", "combine")]
    assert run() == recv
    both = [x for t in (128, 1) for k in ("dispatch", "combine")
            for x in (line(f"{k}_send_t{t}", 8), line(f"{k}_t{t}", 9))]
    assert run(EPX_NCU_HALVES="send recv") == both
    assert run(EPX_NCU_HALVES="recv sent") == ["skip ncu.hook: EPX_NCU_HALVES: 'sent' is "
                                               "neither send nor recv"]


def test_deepep_inputs_finds_the_v1_scripts_in_either_layout(tmp_path):
    """EPX_DEEPEP_SRC names a DeepEP checkout: its tests/ (V1) or, where DeepEP 2.x keeps the V1
    scripts, its tests/legacy/ (bench/peer_deepep.sh then finds their helpers in the checkout)."""
    def tests_dir(src, given=""):
        code = ("skip() { echo SKIP; }\nstep() { return 1; }\n" + script_function("deepep_tests_dir")
                + "\n" + script_function("deepep_inputs")
                + '\ndeepep_inputs peer && echo "TESTS=$DEEPEP_TESTS SELF=$DEEPEP_SELF" || true')
        env = dict(os.environ, EPX_DEEPEP_SRC=str(src), EPX_DEEPEP_TESTS=given)
        return subprocess.run(["bash", "-c", code], env=env, check=True, capture_output=True,
                              text=True).stdout.strip()

    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    (v1 / "tests").mkdir(parents=True)
    (v1 / "tests" / "test_low_latency.py").write_text("")
    (v2 / "tests" / "legacy").mkdir(parents=True)
    (v2 / "tests" / "legacy" / "test_low_latency.py").write_text("")
    assert tests_dir(v1) == f"TESTS={v1}/tests SELF="  # the build step failed: no DeepEP itself
    assert tests_dir(v2) == f"TESTS={v2}/tests/legacy SELF="
    assert tests_dir(v2, given=str(v2 / "tests")) == f"TESTS={v2}/tests/legacy SELF="
    assert tests_dir("", given="") == "SKIP"


def test_ablate_engine_rows_run_each_bit_through_the_diagnostics_copy(tmp_path):
    """ablate's second part: after the bench's rows, a copy of the tree built with
    -DEPX_DIAGNOSTICS=ON and its Python extension (never this tree's python/epx), then
    engine_timing.py --cold once per EPX_ABLATE_BITS value, with EPX_LL_ABLATE set to it and only
    the copy's python/ on PYTHONPATH; an empty EPX_ABLATE_BITS skips that part."""
    out = tmp_path / "out"
    out.mkdir()
    stubs = ('step() { local name=$1; shift 3; echo "STEP $name $*"; }\n'
             'side_build() { echo "SIDE $1 $3 $4 $*"; }\n'
             'pin() { echo env; }\n')

    def run(bits, **more):
        script = (stubs + script_function("tree_copy") + "\n" + script_function("deepep_tests_dir")
                  + "\n" + script_function("batch_ablate") + "\nbatch_ablate")
        env = dict(os.environ, OUT=str(out), EPX_PYTHON="python3", B=str(tmp_path / "b"),
                   G="1", EPX_AB_EXPERTS="288", EPX_DEEPEP_TESTS="", EPX_DEEPEP_SRC="")
        env.update(more)
        if bits is not None:
            env["EPX_ABLATE_BITS"] = bits
        r = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, check=True,
                           capture_output=True, text=True)
        return r.stdout.strip().splitlines()

    lines = run("0 4")
    copy = tmp_path / "b-diagpy"
    sides = [line for line in lines if line.startswith("SIDE ")]
    assert len(sides) == 2 and sides[0].split()[1:4] == ["ablate.build", ".", f"{tmp_path}/b-diag"]
    assert sides[1].split()[1:4] == ["ablate.pybuild", f"{copy}.src", str(copy)]
    assert "-DEPX_DIAGNOSTICS=ON" in sides[1] and "-DEPX_BUILD_PYTHON=ON" in sides[1]
    assert (copy.parent / "b-diagpy.src" / "bench" / "engine_timing.py").exists()  # the copy
    steps = [line for line in lines if line.startswith("STEP ablate.engine")]
    assert [s.split()[1] for s in steps] == ["ablate.engine.b0", "ablate.engine.b4"]
    for s, bits in zip(steps, ("0", "4")):
        assert f"EPX_LL_ABLATE={bits} PYTHONPATH={copy}.src/python python3 " \
               "bench/engine_timing.py --tokens 128 --experts 288 --cold" in s, s
    assert not any(line.startswith("SIDE ablate.pybuild") for line in run(""))
    assert not any(line.startswith("STEP ablate.harness") for line in lines)  # no DeepEP tests


def test_ablate_runs_deepep_harness_per_bit_and_names_repeated_bits_apart(tmp_path):
    """With DeepEP's tests given, ablate runs DeepEP's test_low_latency.py after each
    engine_timing.py process, through the diagnostics copy's drop-in (EPX_REPO) with the same
    EPX_LL_ABLATE and --num-experts E; a value given again gets .2, .3, ... in its steps' names,
    so no log overwrites another."""
    out = tmp_path / "out"
    out.mkdir()
    tests = tmp_path / "deepep" / "tests"
    tests.mkdir(parents=True)
    (tests / "test_low_latency.py").write_text("")
    stubs = ('step() { local name=$1; shift 3; echo "STEP $name $*"; }\n'
             'side_build() { :; }\npin() { echo env; }\n')
    script = (stubs + script_function("tree_copy") + "\n" + script_function("deepep_tests_dir")
              + "\n" + script_function("batch_ablate") + "\nbatch_ablate")

    def run(**more):
        env = dict(os.environ, OUT=str(out), EPX_PYTHON="python3", B=str(tmp_path / "b"), G="1",
                   EPX_AB_EXPERTS="288", EPX_ABLATE_BITS="0 64 0", EPX_DEEPEP_TESTS="",
                   EPX_DEEPEP_SRC="", EPX_DEEPEP_ARGS="")
        env.update(more)
        r = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, check=True,
                           capture_output=True, text=True)
        return [line for line in r.stdout.splitlines() if line.startswith("STEP ablate.")]

    copy = f"{tmp_path}/b-diagpy.src"
    steps = run(EPX_DEEPEP_TESTS=str(tests))
    assert [s.split()[1] for s in steps] == [
        "ablate.ll", "ablate.engine.b0", "ablate.harness.b0", "ablate.engine.b64",
        "ablate.harness.b64", "ablate.engine.b0.2", "ablate.harness.b0.2"]
    for s, bits in zip(steps[2::2], ("0", "64", "0")):
        assert s.endswith(f"env EPX_LL_ABLATE={bits} EPX_REPO={copy} EPX_DEEPEP_ARGS=--num-experts "
                          f"288 bash bench/peer_deepep.sh {tests} 1 test_low_latency.py"), s
    # DeepEP 2.x's layout (tests/legacy/), found from the checkout; more script arguments kept.
    legacy = tmp_path / "v2" / "tests" / "legacy"
    legacy.mkdir(parents=True)
    (legacy / "test_low_latency.py").write_text("")
    steps = run(EPX_DEEPEP_SRC=str(tmp_path / "v2"), EPX_DEEPEP_ARGS="--num-tokens 32")
    assert steps[2].endswith(f"EPX_DEEPEP_ARGS=--num-experts 288 --num-tokens 32 bash "
                             f"bench/peer_deepep.sh {legacy} 1 test_low_latency.py"), steps[2]
