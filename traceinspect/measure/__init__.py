"""Stage 5, measure: time per class, GEMM efficiency, memory bandwidth, collectives.

Inputs: the analysis record (:class:`~traceinspect.model.analysis.Analysis`) of the classified steps.
Outputs: GEMM and memory efficiency, the collectives across ranks, the host activity, clock warnings.
"""
