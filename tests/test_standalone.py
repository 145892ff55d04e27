"""The repository stands alone: someone who clones it has no folder beside it,
so nothing the tests, benchmarks or README use may live outside it."""
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# A path that leaves the repository: ../something (the planners' shared/
# folder sits beside the checkout, not in it).
OUTSIDE = re.compile(r"\.\./shared|parents\[\d\]\s*\.parent|ROOT\.parent|REPO\.parent")


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_no_file_reads_outside_the_repo():
    hits = []
    for name in tracked_files():
        if not name.endswith((".py", ".sh", ".md", ".toml", ".txt", "Makefile", "run")) or name.startswith("tests/data/"):
            continue
        for i, line in enumerate((REPO / name).read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line) and name != "tests/test_standalone.py":
                hits.append(f"{name}:{i}: {line.strip()}")
    assert not hits, "paths outside the repository:\n" + "\n".join(hits)


def test_a_clone_finds_its_data_and_notes(tmp_path):
    """A clone into an empty folder (nothing beside it) finds the text the tests
    and benchmarks read, and the architecture notes the README points at."""
    clone = tmp_path / "empty" / "tqserve"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=120)
    assert not (clone.parent / "shared").exists()
    code = ("import sys; sys.path[:0] = ['tests', 'tests/bench'];"
            "from fixtures_models import shakespeare_text; import bench_paths;"
            "t = shakespeare_text(); assert len(t) > 1_000_000, len(t);"
            "assert bench_paths.DATA.read_text() == t; print(bench_paths.DATA)")
    r = subprocess.run([sys.executable, "-c", code], cwd=clone, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).is_relative_to(clone)
    readme = (clone / "README.md").read_text()
    assert "docs/architecture.md" in readme and (clone / "docs" / "architecture.md").exists()
