"""Entry point: `python3 scripts/megakernel_layer.py --help` (the code: k3export/megakernel/layer.py)."""
from k3export.megakernel.layer import main

if __name__ == "__main__":
    main()
