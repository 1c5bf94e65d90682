"""`python -m tritonllm COMMAND ...`: the same as the `tritonllm` console script."""

from tritonllm.cli import main

raise SystemExit(main())
