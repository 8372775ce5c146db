"""Build: the package, ``rules/`` shipped as ``traceinspect/rules`` and ``fixtures/`` (the trace sets the
shipped rules name in ``tests.fires``/``silent``, so ``traceinspect rules test`` runs installed) as
``traceinspect/fixtures``, the native Kineto scanner and the merged trace's row writer.

Both are optional: where no C compiler is available the build goes on without them, the loader uses
its pure-Python (msgspec) path and the merged trace is encoded from Python objects.
"""

from setuptools import Extension, find_packages, setup

setup(
    packages=[*find_packages(include=["traceinspect", "traceinspect.*"]), "traceinspect.rules",
              "traceinspect.fixtures"],
    package_dir={"traceinspect.rules": "rules", "traceinspect.fixtures": "fixtures"},
    package_data={"traceinspect.rules": ["*.yaml", "tables/*.yaml"], "traceinspect.render": ["templates/*"],
                  "traceinspect.fixtures": ["**/*"]},
    ext_modules=[
        Extension(
            "traceinspect.load._kineto_scan",
            ["traceinspect/load/_kineto_scan.c"],
            extra_compile_args=["-O2", "-std=c99"],
            optional=True,
        ),
        Extension(
            "traceinspect.render._json_rows",
            ["traceinspect/render/_json_rows.c"],
            extra_compile_args=["-O2", "-std=c99"],
            optional=True,
        ),
    ],
)
