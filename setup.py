"""Build hook for the optional C kernel of the planner; everything else is in pyproject.toml.

``schedulers.planning._pd_native`` is compiled when a C compiler is present. It is optional:
without a compiler the install still succeeds and the planner uses its pure-Python core.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "schedulers.planning._pd_native",
            ["schedulers/planning/_pd_native.c"],
            optional=True,
            # No fused multiply-add: the kernel's floating-point results equal the Python core's.
            extra_compile_args=["-O2", "-ffp-contract=off"],
        )
    ]
)
