#!/usr/bin/env python3
"""Build what `make serve` serves: the model folder, build/model_repository and build/manifest.json.

python build_engines.py                      # packaged SmolLM2-135M-Instruct, portable engine
python build_engines.py --model DIR_OR_GGUF  # another model
"""

import sys

from tritonllm.repository.builder import main

if __name__ == "__main__":
    sys.exit(main())
