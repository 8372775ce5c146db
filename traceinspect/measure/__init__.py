"""Stage 5, measure: time per class, GEMM efficiency, memory bandwidth, collectives."""
