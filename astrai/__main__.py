import sys

from astrai.cli import main

sys.exit(main())
