"""Test harness only: an import stand-in for ``sgl_kernel`` (SGLang's CUDA/AMX kernels).

SGLang imports a few names from it at module load; with
``attention_backend="torch_native"`` on CPU none of them is ever called. Every name is
a placeholder that raises if it is called, so a run that needs a real kernel fails
loudly instead of computing something else.
"""

__version__ = "0.0.0+ems-test-shim"


class _Missing:
    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError(f"sgl_kernel test shim: {self._name} is not available")

    def __getattr__(self, item: str) -> "_Missing":
        return _Missing(f"{self._name}.{item}")


def __getattr__(name: str) -> _Missing:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing(name)
