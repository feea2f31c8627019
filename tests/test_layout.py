"""The distribution's promises about its layout."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_service_imports_without_torch() -> None:
    # The collector is installed without the `agent` extra: importing it must never pull torch in.
    code = textwrap.dedent(
        """
        import sys
        class _NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is blocked in this test")
                return None
        sys.meta_path.insert(0, _NoTorch())
        import quantwatch.service, quantwatch.cli
        import pkgutil, importlib
        for mod in pkgutil.walk_packages(quantwatch.service.__path__, "quantwatch.service."):
            importlib.import_module(mod.name)
        print("torch" in sys.modules)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_cli_reports_version() -> None:
    from quantwatch import __version__

    out = subprocess.run(
        [sys.executable, "-m", "quantwatch.cli", "version"], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == __version__
