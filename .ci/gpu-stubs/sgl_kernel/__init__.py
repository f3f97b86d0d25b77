"""Import-time stand-in for SGLang's CUDA kernel package (sgl-kernel, several hundred MB) on GPU test machines that
lack it. SGLang imports it at module level on CUDA; the tpa backend, SGLang's Triton backend and its dense attention
test kit call none of its kernels. Every name, in this module or any submodule, is a stand-in that raises if it is
ever called, except the device query in ``utils``."""

import importlib.abc
import importlib.machinery
import sys
import types


class _Missing:
    """Stands for any sgl_kernel object: attributes give more stand-ins, calling one raises."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"sgl_kernel.{self._name} was called, but sgl-kernel is not installed on this machine")


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing(name)


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = __getattr__
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_Submodules())
