"""Build: the package, ``rules/`` shipped as ``traceinspect/rules``, the trace sets the shipped rules name in
``tests.fires``/``silent``/``undecided`` and the model configs those tests name (so ``traceinspect rules
test`` runs installed) as ``traceinspect/fixtures``, the native Kineto scanner and the merged trace's row writer.

Only those sets go into the wheel (:data:`RULE_FIXTURES`; tests/test_install.py checks that they are
exactly the ones the rules name, and the wheel's size); the other fixtures stay in the repository, where
the tests check the rules on every set.

Both extensions are optional: where no C compiler is available the build goes on without them, the loader
uses its pure-Python (msgspec) path and the merged trace is encoded from Python objects.
"""

from setuptools import Extension, find_packages, setup

# fixtures/<set>: the trace sets the shipped rules name (rules/*.yaml ``tests``)
RULE_FIXTURES = [
    "kv-gather-cast-graph",
    "slow-rank-eager",
    "tp1-l6-full-graph",
    "tp1-l6-full-graph-nocapture",
    "tp1-l6-gather-graph-bs16",
    "rule-tests/comm-bound-graph",
    "rule-tests/host-sync-graph",
    "rule-tests/moe-dispatch-eager",
]
# fixtures/<file>: the model configs rule tests analyse a set with (``DIR --model-config FILE``)
RULE_MODEL_CONFIGS = ["generate/tiny-mla-moe.config.json"]

setup(
    packages=[*find_packages(include=["traceinspect", "traceinspect.*"]), "traceinspect.rules",
              "traceinspect.fixtures"],
    package_dir={"traceinspect.rules": "rules", "traceinspect.fixtures": "fixtures"},
    # package data is what is listed here, not everything MANIFEST.in puts into the source distribution
    include_package_data=False,
    package_data={"traceinspect.rules": ["*.yaml", "tables/*.yaml"], "traceinspect.render": ["templates/*"],
                  "traceinspect.fixtures": [f"{d}/{pat}" for d in RULE_FIXTURES
                                            for pat in ("*.json", "*.json.gz", "graph_capture_profile/*.json.gz")]
                  + RULE_MODEL_CONFIGS},
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
