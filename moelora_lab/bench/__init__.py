"""Benchmarks on a CUDA GPU: ``python -m moelora_lab.bench <subcommand>`` (``--help`` lists them).

One module per subcommand, each with ``add_parser(sub)`` and ``run(args) -> rows``:
``kernels_sweep`` (kernels), ``registers_sweep`` (registers), ``layer_sweep`` (layer),
``align_sweep`` (align), ``gemm_sweep`` (gemm), ``eager_sweep`` (eager), ``tune_sweep`` (tune),
``layout_sweep`` (layout). ``common`` holds what they share (the device, the sweep's routing, the
common arguments, the recorded command); ``cli`` parses the command line and writes the CSV, and
only ``__main__`` imports it. Rows are written and read back with :mod:`moelora_lab.results`.
Nothing in the library imports this package.
"""
