"""Entry point: `python3 scripts/megakernel_chain.py --help` (the code: k3export/megakernel/chain.py)."""
from k3export.megakernel.chain import main

if __name__ == "__main__":
    main()
