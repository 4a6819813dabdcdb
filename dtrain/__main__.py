from dtrain.app.cli import main

raise SystemExit(main())
