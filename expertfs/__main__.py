from expertfs.cli import main

raise SystemExit(main())
