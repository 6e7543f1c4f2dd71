"""Where the kernels run: on a CUDA device compiled, elsewhere under the Triton interpreter.

``pagedflash/__init__.py`` imports this module before anything defines a kernel. Without a CUDA
device it sets ``TRITON_INTERPRET=1``, unless the user set the variable (either way: their choice is
kept). ``@triton.jit`` reads the switch when it defines a kernel, so pagedflash's own kernels follow
it even when triton was imported first (by the user, or by transformers or torch.compile). Triton's
own library functions (``tl.cdiv``, ``tl.sum``, ``tl.max``, ...) were defined at that earlier import,
for the compiler; with the interpreter on they are redefined for it, as importing triton with the
switch on would have defined them. A triton whose internals do not allow that gets one clear
``ImportError`` saying what to do, instead of kernels that fail later with
``RuntimeError: 0 active drivers``.
"""

import os
import sys


def interpret_requested() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for the interpreter (as triton parses it)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _configure_interpreter() -> None:
    if "TRITON_INTERPRET" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    if interpret_requested() and "triton" in sys.modules:
        _interpret_imported_triton()


def _interpret_imported_triton() -> None:
    """Redefine, for the interpreter, the jit functions of ``triton.language`` that an import made
    before the switch was on defined for the compiler (a no-op when they are interpreted already)."""
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None and not knobs.runtime.interpret:  # turned off in Python: the user's choice
        return
    applied: list[tuple[object, str, object]] = []  # (owner, name, original), to undo on failure
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        owners = [m for name, m in list(sys.modules.items())
                  if m is not None and (name == "triton.language" or name.startswith("triton.language."))]
        owners.append(triton.language.tensor)  # member functions: x.sum(), x.to(...)
        interpreted: dict[int, InterpretedFunction] = {}  # by id: one replacement per function
        plan = []  # every replacement is built before any is applied
        for owner in owners:
            for name, value in list(vars(owner).items()):
                if isinstance(value, JITFunction):
                    if id(value) not in interpreted:
                        interpreted[id(value)] = InterpretedFunction(value.fn)
                    plan.append((owner, name, value, interpreted[id(value)]))
        for owner, name, value, replacement in plan:
            setattr(owner, name, replacement)
            applied.append((owner, name, value))
        if any(isinstance(v, JITFunction) for owner in owners for v in vars(owner).values()):
            raise RuntimeError("some triton.language functions stayed compiled")
    except Exception as e:  # noqa: BLE001 - any failure here means the same thing to the user
        for owner, name, value in reversed(applied):  # all or nothing: triton is left as it was
            setattr(owner, name, value)
        raise ImportError(
            f"pagedflash: triton {getattr(triton, '__version__', '?')} was imported before pagedflash, "
            f"set up to compile for a GPU, and cannot be switched to its CPU interpreter now ({e}). "
            "pagedflash's kernels need the interpreter here (no CUDA device, or TRITON_INTERPRET=1): "
            "import pagedflash before triton (and before transformers or torch.compile, which import "
            "it), or start Python with TRITON_INTERPRET=1 in the environment."
        ) from e


_configure_interpreter()
