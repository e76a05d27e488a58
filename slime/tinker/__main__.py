from slime.tinker.cli import main

raise SystemExit(main())
