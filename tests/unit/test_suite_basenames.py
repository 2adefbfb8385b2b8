"""The whole suite is collected in one pytest run with rootdir-relative module names: two test files with one
basename (tests/unit/test_x.py and tests/integration/test_x.py) stop the collection of everything, which only the
whole-suite run shows. This catches it in the unit suite, where a helper's run sees it."""

from pathlib import Path


def test_every_test_module_basename_is_unique() -> None:
    tests = Path(__file__).resolve().parent.parent
    seen: dict[str, Path] = {}
    clashes = []
    for p in sorted(tests.rglob("test_*.py")):
        if p.name in seen:
            clashes.append(f"{seen[p.name].relative_to(tests)} and {p.relative_to(tests)}")
        seen.setdefault(p.name, p)
    assert len(seen) > 50, "the walk found the suite's test files"
    assert not clashes, "test modules sharing a basename: " + "; ".join(clashes)
