"""CoMemo demo alone: ``python -m apps.comemo`` serves the CoMemo tab on 127.0.0.1:7860."""
from apps.hub import main

if __name__ == "__main__":
    main(app="comemo")
