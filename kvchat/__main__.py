import sys

from kvchat.cli import main

sys.exit(main())
