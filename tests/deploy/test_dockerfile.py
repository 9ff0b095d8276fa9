"""deploy/Dockerfile and .dockerignore, read instruction by instruction (no Docker engine needed)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import click
import pytest
from setuptools import find_packages

from tests.deploy import deployfiles as df

PYPROJECT = tomllib.loads((df.REPO / "pyproject.toml").read_text())
SOURCE = {"store", "worker", "gateway"}


@pytest.fixture(scope="module")
def instructions() -> list[df.Instruction]:
    return df.parse_dockerfile(df.DOCKERFILE.read_text())


def final_stage(instructions: list[df.Instruction]) -> list[df.Instruction]:
    last = max(i.stage for i in instructions)
    return [i for i in instructions if i.stage == last]


def arg_defaults(instructions: list[df.Instruction]) -> dict[str, str]:
    out = {}
    for i in instructions:
        if i.cmd == "ARG" and "=" in i.args:
            name, _, value = i.args.partition("=")
            out[name] = " ".join(shlex.split(value))
    return out


def copies_source(i: df.Instruction) -> bool:
    if i.cmd not in ("COPY", "ADD"):
        return False
    sources, flags = df.copy_sources(i)
    return "from" not in flags and any(s.strip("./") in SOURCE or s in (".", "./") for s in sources)


def test_parser_reads_the_dockerfile(instructions: list[df.Instruction]) -> None:
    cmds = [i.cmd for i in instructions]
    assert cmds.count("FROM") >= 2 and "RUN" in cmds and "COPY" in cmds
    assert all(c.isalpha() for c in cmds), cmds


def test_python_311_slim_base(instructions: list[df.Instruction]) -> None:
    args = arg_defaults([i for i in instructions if i.stage == -1])  # ARGs before the first FROM
    for i in instructions:
        if i.cmd == "FROM":
            image = i.args.split()[0]
            image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), image)
            assert re.fullmatch(r"python:3\.11-slim(-\w+)?", image), f"line {i.line}: FROM {image}"


def test_llama_cpp_python_is_the_pinned_version(instructions: list[df.Instruction]) -> None:
    pins = [d for d in PYPROJECT["project"]["dependencies"] if d.startswith("llama-cpp-python")]
    assert pins == [f"llama-cpp-python=={arg_defaults(instructions)['LLAMA_CPP_PYTHON_VERSION']}"], (
        "LLAMA_CPP_PYTHON_VERSION in deploy/Dockerfile differs from pyproject.toml's pin"
    )


def test_llama_cpp_python_is_portable(instructions: list[df.Instruction]) -> None:
    text = df.DOCKERFILE.read_text()
    cmake_args = re.search(r'ARG CMAKE_ARGS="([^"]*)"', text)
    assert cmake_args, "no ARG CMAKE_ARGS=... in the Dockerfile"
    flags = cmake_args.group(1).split()
    assert "-DGGML_NATIVE=OFF" in flags, "without GGML_NATIVE=OFF the image only runs on CPUs like the build machine's"
    for off in ("LLAVA_BUILD", "LLAMA_BUILD_TESTS", "LLAMA_BUILD_EXAMPLES", "LLAMA_BUILD_TOOLS", "LLAMA_BUILD_SERVER"):
        assert f"-D{off}=OFF" in flags
    build = [i for i in instructions if i.cmd == "RUN" and "deploy/llama-wheel.sh" in i.args]
    assert build, "the image does not build llama-cpp-python with deploy/llama-wheel.sh (the patched build setup.sh installs)"
    assert "CMAKE_ARGS" in build[0].args and "LLAMA_CPP_PYTHON_VERSION" in build[0].args
    script = (df.DEPLOY / "llama-wheel.sh").read_text()
    assert "--no-cache-dir" in script, "pip's wheel cache ignores CMAKE_ARGS: a changed flag would reuse an old build"


def test_runtime_has_the_shared_libraries_of_llama_cpp(instructions: list[df.Instruction]) -> None:
    """llama.cpp's libraries link OpenMP (libgomp), which the slim base image lacks."""
    import llama_cpp

    libs = sorted((Path(llama_cpp.__file__).parent / "lib").glob("*.so*"))
    assert libs, "llama_cpp ships no shared libraries here"
    ldd = shutil.which("ldd")
    assert ldd, "ldd is missing (Debian package libc-bin)"
    needed = set()
    for lib in libs:
        out = subprocess.run([ldd, str(lib)], check=False, capture_output=True, text=True, timeout=30).stdout
        needed |= set(re.findall(r"^\s*(\S+\.so\.\d+) =>", out, re.MULTILINE))
    installed = " ".join(i.args for i in final_stage(instructions) if i.cmd == "RUN" and "apt-get install" in i.args)
    if "libgomp.so.1" in needed:
        assert "libgomp1" in installed, "llama.cpp needs libgomp.so.1: apt-get install libgomp1 in the final stage"


def test_llama_cpp_python_installed_before_the_source_is_copied(instructions: list[df.Instruction]) -> None:
    """Editing kvpool's code must not rebuild llama.cpp: its layers come before any COPY of the source."""
    build = [
        n for n, i in enumerate(instructions) if i.cmd == "RUN" and re.search(r"pip (wheel|install)\b.*llama[-_]cpp[-_]python", i.args)
    ]
    copies = [n for n, i in enumerate(instructions) if copies_source(i)]
    assert build, "no RUN builds or installs llama-cpp-python"
    assert copies, "no COPY of the kvpool source"
    assert max(build) < min(copies), (
        f"llama-cpp-python is built/installed at line {instructions[max(build)].line}, after the source COPY at line {instructions[min(copies)].line}"
    )
    # ... and so are the dependencies, read from pyproject.toml alone.
    deps = [n for n, i in enumerate(instructions) if i.cmd == "RUN" and "pyproject.toml" in i.args and "pip install" in i.args]
    assert deps and max(deps) < min(copies)


def test_the_image_installs_the_runtime_dependencies_and_the_model_generator(instructions: list[df.Instruction]) -> None:
    """The requirements the image installs, computed by its own command: the runtime ones, and gguf for the compose model job."""
    (run,) = [i for i in instructions if i.cmd == "RUN" and "pyproject.toml" in i.args and "pip install" in i.args]
    words = shlex.split(run.args)
    code = words[words.index("python") + 2]
    assert words[words.index("python") + 1] == "-c"
    listed = subprocess.run([sys.executable, "-c", code], cwd=df.REPO, capture_output=True, text=True, check=True).stdout.split("\n")
    project = PYPROJECT["project"]
    assert [r for r in listed if r] == project["dependencies"] + project["optional-dependencies"]["synth"]
    assert "kvpool model make" in df.compose_text(), "the compose stack no longer generates models: drop the synth extra from the image"


def test_every_package_is_copied(instructions: list[df.Instruction]) -> None:
    """The packages setuptools installs (pyproject's packages.find) are all in the image."""
    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    top = {p.split(".")[0] for p in find_packages(where=str(df.REPO), include=include)}
    copied = {s.strip("./") for i in instructions if copies_source(i) for s in df.copy_sources(i)[0]}
    assert top <= copied, f"packages not copied into the image: {sorted(top - copied)}"


def test_copied_files_are_in_the_build_context(instructions: list[df.Instruction]) -> None:
    """Every COPY source exists in the repository and .dockerignore does not exclude it."""
    patterns = df.dockerignore_patterns()
    for i in instructions:
        if i.cmd not in ("COPY", "ADD"):
            continue
        sources, flags = df.copy_sources(i)
        if "from" in flags:
            continue
        for src in sources:
            assert (df.REPO / src).exists(), f"line {i.line}: {src} is not in the repository"
            assert not df.dockerignored(src, patterns), f"line {i.line}: .dockerignore excludes {src}"
    readme = PYPROJECT["project"].get("readme")
    copied = {s for i in instructions if i.cmd == "COPY" for s in df.copy_sources(i)[0]}
    assert readme in copied, f"pyproject.toml names {readme}: building the package needs it"


def test_dockerignore_keeps_local_state_out() -> None:
    patterns = df.dockerignore_patterns()
    for path in (".git", ".kvpool/venv/bin/python", ".kvpool/wheels/x.whl", "deploy/.env", "tests/conftest.py", "store/__pycache__/x.pyc"):
        assert df.dockerignored(path, patterns), f".dockerignore lets {path} into the build context"
    for path in ("pyproject.toml", "README.md", "store/store.py", "gateway/app.py", "worker/process/main.py", "deploy/patches/x.patch"):
        assert not df.dockerignored(path, patterns), f".dockerignore excludes {path}"


def test_runs_as_a_non_root_user(instructions: list[df.Instruction]) -> None:
    users = [i for i in final_stage(instructions) if i.cmd == "USER"]
    assert users, "the final stage has no USER: the containers would run as root"
    user = users[-1].args.split(":")[0]
    assert user not in ("root", "0"), f"USER {users[-1].args}"
    if not user.isdigit():
        pytest.fail(f"USER {user}: use a numeric uid, so that Kubernetes' runAsNonRoot can check it")
    created = [i for i in final_stage(instructions) if i.cmd == "RUN" and "useradd" in i.args]
    assert created and f"--uid {user}" in created[0].args, f"uid {user} is not created in the final stage"


def test_entrypoint_is_kvpool(instructions: list[df.Instruction]) -> None:
    from gateway.cli import main

    stage = final_stage(instructions)
    (entrypoint,) = [df.exec_form(i.args) for i in stage if i.cmd == "ENTRYPOINT"]
    assert entrypoint == ["kvpool"], 'ENTRYPOINT must be the exec form ["kvpool"]'
    assert PYPROJECT["project"]["scripts"]["kvpool"] == "gateway.cli:main"
    (cmd,) = [df.exec_form(i.args) for i in stage if i.cmd == "CMD"]
    assert cmd and main.get_command(click.Context(main), cmd[0]) is not None, f"CMD {cmd}: not a kvpool command"


def test_image_environment_is_kvpool_settings(instructions: list[df.Instruction]) -> None:
    from gateway.pool.envfile import image_env

    env = image_env(df.DEPLOY)
    kv = {k for k in env if k.startswith(df.ENV_PREFIX)}
    assert kv <= set(df.settings()), f"not kvpool settings: {sorted(kv - set(df.settings()))}"
    home = env["KVPOOL_STATE_DIR"]
    stage = final_stage(instructions)
    assert any(i.cmd == "RUN" and "chown" in i.args and home in i.args for i in stage), f"{home} is not given to the kvpool user"


def test_exposed_ports_match_compose(instructions: list[df.Instruction]) -> None:
    exposed = {p for i in final_stage(instructions) if i.cmd == "EXPOSE" for p in i.args.split()}
    services = df.compose()["services"]
    assert df.environment(services["gateway"])["KVPOOL_PORT"] in exposed
    assert df.environment(services["worker"])["KVPOOL_METRICS_PORT"] in exposed
