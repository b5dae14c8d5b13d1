"""The prologue of a kernel launched with programmatic dependent launch (``_triton_launch.pdl_options``).

Every kernel that takes ``PDL`` calls ``pdl_prologue(PDL)`` as its first statement, in every program, before any
load or store: a program may start while the previous kernel of the stream still runs, and ``gdc_wait`` returns
once that kernel has completed with its writes visible (it has itself waited on its own predecessor, so the whole
stream order holds). ``gdc_launch_dependents`` then lets the next kernel's programs be scheduled as this kernel's
last programs start, so its launch overlaps this kernel's work. Both are no-ops in a launch without the attribute;
PDL is a constexpr, so kernels compiled without it (older GPUs, the interpreter) contain neither instruction.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
