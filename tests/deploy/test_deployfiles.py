"""The readers in deployfiles.py, on small inputs: the other deploy tests rely on them."""

from __future__ import annotations

import pytest

from tests.deploy import deployfiles as df


@pytest.mark.parametrize(
    ("text", "env", "expected"),
    [
        ("${A:-x}", {}, "x"),
        ("${A:-x}", {"A": ""}, "x"),
        ("${A-x}", {"A": ""}, ""),
        ("${A:-x}", {"A": "y"}, "y"),
        ("${A}/$B", {"A": "1", "B": "2"}, "1/2"),
        ("$${A:-x} $$B", {"A": "1"}, "${A:-x} $B"),
        ("${A:+set}", {"A": "1"}, "set"),
        ("${PUBLISH_ADDRESS:-127.0.0.1}:${GATEWAY_PORT:-8000}:8000", {}, "127.0.0.1:8000:8000"),
    ],
)
def test_interpolation(text: str, env: dict[str, str], expected: str) -> None:
    assert df.interpolate_str(text, env) == expected


def test_required_variable() -> None:
    with pytest.raises(KeyError):
        df.interpolate_str("${A:?set A}", {})


def test_references_skip_escapes() -> None:
    refs = df.references({"a": ["$${NOT}", "${YES:-1}"], "b": "$ALSO"})
    assert [(r.name, r.op, r.arg) for r in refs] == [("YES", ":-", "1"), ("ALSO", None, None)]


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("127.0.0.1:8000:8000", ("127.0.0.1", "8000", "8000")),
        ("8000:80", (None, "8000", "80")),
        ("9100", (None, None, "9100")),
        ("53:53/udp", (None, "53", "53")),
        ({"target": 80, "published": 8080, "host_ip": "127.0.0.1"}, ("127.0.0.1", "8080", "80")),
    ],
)
def test_parse_port(spec: object, expected: tuple[object, ...]) -> None:
    assert df.parse_port(spec) == expected  # type: ignore[arg-type]


def test_dockerignore_matching() -> None:
    patterns = [".kvpool", "**/__pycache__", "tests", "*.egg-info", "!tests/keep.py"]
    assert df.dockerignored(".kvpool/venv/bin/python", patterns)
    assert df.dockerignored("store/__pycache__/a.pyc", patterns)
    assert df.dockerignored("__pycache__/a.pyc", patterns)
    assert df.dockerignored("kvpool.egg-info/PKG-INFO", patterns)
    assert not df.dockerignored("store/store.py", patterns)
    assert not df.dockerignored("tests/keep.py", patterns)
    assert df.dockerignored("tests/other.py", patterns)


def test_dockerfile_parser() -> None:
    text = 'ARG X=1\n# c\nFROM a AS b\nRUN one \\\n    # inside\n    two\nCOPY --from=b /w /w\nENTRYPOINT ["k"]\nFROM c\nUSER 1\n'
    ins = df.parse_dockerfile(text)
    assert [(i.cmd, i.stage) for i in ins] == [
        ("ARG", -1),
        ("FROM", 0),
        ("RUN", 0),
        ("COPY", 0),
        ("ENTRYPOINT", 0),
        ("FROM", 1),
        ("USER", 1),
    ]
    assert ins[2].args == "one two" and ins[2].line == 4
    assert df.copy_sources(ins[3]) == (["/w"], {"from": "b"})
    assert df.exec_form(ins[4].args) == ["k"]
    assert df.exec_form("kvpool gateway") is None
