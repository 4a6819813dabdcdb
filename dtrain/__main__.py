from dtrain.cli import main

raise SystemExit(main())
