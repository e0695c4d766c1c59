"""The ground floor: launching Triton kernels (compile forms, the direct launch path, compile-only
warm-up), reusable scratch buffers and host arithmetic. Imports nothing else of ``kernels``."""
