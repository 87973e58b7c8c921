"""Everything is in pyproject.toml but one build step: `zerodp-deepspeed-alias.pth` goes to the top of
site-packages (Python runs a .pth file's `import` line at every start-up), so ZERODP_DEEPSPEED_ALIAS=1
reaches every process (src/_zerodp_deepspeed_alias.py). setuptools copies only packages and modules, so
build_py copies it: into the wheel's root, or in an editable install (`pip install -e`, which `make setup`
runs) into the editable wheel, which setuptools assembles in the install command's `install_lib`."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = Path(__file__).resolve().parent / "src" / "zerodp-deepspeed-alias.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        if self.editable_mode:
            target = self.distribution.get_command_obj("install").install_lib
        else:
            target = self.build_lib
        self.copy_file(str(PTH), str(Path(target) / PTH.name), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        return outputs if self.editable_mode else [*outputs, str(Path(self.build_lib) / PTH.name)]


setup(cmdclass={"build_py": BuildPyWithPth})
