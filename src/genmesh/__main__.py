from genmesh.cli import main

raise SystemExit(main())
