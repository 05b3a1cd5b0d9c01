from compressors._native import _main

raise SystemExit(_main())
