"""The builds of the native kernels: their -march target by argument, environment or default, and the vector code
each build holds, checked in its machine code on any x86-64 host (whether or not this CPU can execute it)."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess

import pytest

from quantwatch.kernels import native

# Target, the register of its vector unit, and the registers it must not use.
VECTOR_CODE = {"haswell": ("ymm", "zmm"), "x86-64-v4": ("zmm", None)}
# Scalar single-precision instructions (addss, vmaxss, ...): a kernel that fell back from vectors is full of them.
SCALAR_SINGLE = re.compile(r"^\s*[0-9a-f]+:\s+v?[a-z0-9]+ss\s", re.MULTILINE)


def test_the_target_is_argument_then_environment_then_native(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(native.MARCH_ENV, raising=False)
    assert native.march() == "native"
    assert "-march=native" in native.flags()
    monkeypatch.setenv(native.MARCH_ENV, "haswell")
    assert native.march() == "haswell"
    assert native.march("x86-64-v4") == "x86-64-v4"
    assert "-march=haswell" in native.flags()
    assert "-march=native" not in native.flags()


@pytest.mark.parametrize("value", ["", "haswell -O0", "-fplugin=x", "a;b", "x" * 65])
def test_a_target_that_is_no_plain_name_is_a_clear_error(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.MARCH_ENV, value)
    if value == "":  # unset and empty alike: the default
        assert native.march() == "native"
        return
    with pytest.raises(ValueError, match="QUANTWATCH_NATIVE_MARCH"):
        native.march()


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 vector units")
@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) reads the machine code")
@pytest.mark.parametrize("target", list(VECTOR_CODE))
def test_each_build_holds_its_vector_code(target: str) -> None:
    library = native.build(target=target)  # the one test_native.py loads (the same cache key)
    code = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", str(library)], capture_output=True, text=True, check=True
    ).stdout
    register, never = VECTOR_CODE[target]
    vector = code.count(f"%{register}")
    scalar = len(SCALAR_SINGLE.findall(code))
    assert vector > 2000, (target, vector)
    # Before the kernels were written for 8-float vectors the haswell build held 16,930 scalar ones beside 7,449 ymm.
    assert scalar < vector / 10, (target, scalar, vector)
    if never:
        assert f"%{never}" not in code
